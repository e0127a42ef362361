/* native_choice.h: how the native core's choice programs answer a request (tests/capi/native_choice.c,
   native_decode_choice.c): one line, "ok VARIANT KEY" or "error MESSAGE". */
#ifndef NATIVE_CHOICE_H
#define NATIVE_CHOICE_H

#include <stdio.h>

#include "lt_native.h"

/* The answer for a choice that returned status into v (err: why not). */
static void print_choice(int status, const ltn_variant *v, const ltn_error *err) {
    char text[1024], key[33];
    if (status != LTN_OK)
        printf("error %s\n", err->message);
    else if (ltn_variant_string(v, text, sizeof text) != 0 || ltn_variant_key(v, key) != 0)
        printf("error no string or key\n");
    else
        printf("ok %s %s\n", text, key);
}

#endif
