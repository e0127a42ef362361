/*
 * lt_python.c: the start of the interpreter liblazytriton.so embeds (included
 * by lazytriton.c in that library only; liblazytriton_native.so has none).
 */

static int lt__python_state; /* 0: not started, 1: running, -1: failed (for good) */
static char lt__python_error[1024];

/* Registered only when this library started the interpreter (which nothing
 * finalizes): a host that runs Python flushes through Python's own atexit. */
static void lt__at_exit(void) {
    if (__atomic_load_n(&lt__python_state, __ATOMIC_ACQUIRE) == 1 && Py_IsInitialized())
        lt__py_flush(); /* counters kept in memory (cache hits) */
}

/* Start the interpreter the library was built with (its venv too), unless the
 * host process already runs one. Called under lt__init_lock. */
static lt_status lt__start_python(void) {
    if (lt__python_state == 1)
        return LT_OK;
    if (lt__python_state == -1)
        return lt__fail(LT_ERROR_PYTHON, "%s", lt__python_error);
    if (LT__LIBPYTHON[0] != '\0') /* extension modules need libpython's symbols global */
        dlopen(LT__LIBPYTHON, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    int started_here = !Py_IsInitialized();
    if (started_here) {
        PyConfig config;
        PyConfig_InitPythonConfig(&config);
        config.install_signal_handlers = 0; /* the host's signals stay the host's */
        config.parse_argv = 0;
        const char *env = getenv("PYTHONPATH");
        size_t size = (env ? strlen(env) : 0) + sizeof LT__PYTHONPATH + 2;
        char *path = (char *)malloc(size);
        PyStatus status = PyStatus_Ok();
        if (path == NULL) {
            status = PyStatus_NoMemory();
        } else {
            snprintf(path, size, "%s%s%s", env ? env : "", env && env[0] && LT__PYTHONPATH[0] ? ":" : "",
                     LT__PYTHONPATH);
            if (LT__PYTHON_EXECUTABLE[0] != '\0')
                status = PyConfig_SetBytesString(&config, &config.program_name, LT__PYTHON_EXECUTABLE);
            if (!PyStatus_Exception(status) && path[0] != '\0')
                status = PyConfig_SetBytesString(&config, &config.pythonpath_env, path);
            free(path);
        }
        if (!PyStatus_Exception(status))
            status = Py_InitializeFromConfig(&config);
        PyConfig_Clear(&config);
        if (PyStatus_Exception(status)) {
            snprintf(lt__python_error, sizeof lt__python_error, "the embedded Python (%s) failed to start: %s%s%s",
                     LT__PYTHON_EXECUTABLE, status.func ? status.func : "", status.func ? ": " : "",
                     status.err_msg ? status.err_msg : "unknown error");
            lt__python_state = -1;
            return lt__fail(LT_ERROR_PYTHON, "%s", lt__python_error);
        }
        PyEval_SaveThread(); /* release the GIL: each call takes it */
    }
    if (cffi_start_python() != 0) {
        snprintf(lt__python_error, sizeof lt__python_error, "lazytriton's embedded module failed to initialise "
                 "in the Python of %s (its traceback went to stderr)", LT__PYTHON_EXECUTABLE);
        lt__python_state = -1;
        return lt__fail(LT_ERROR_PYTHON, "%s", lt__python_error);
    }
    __atomic_store_n(&lt__python_state, 1, __ATOMIC_RELEASE);
    if (started_here)
        atexit(lt__at_exit);
    return LT_OK;
}
