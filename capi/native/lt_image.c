/*
 * lt_image.c: reading an image (cache_format/SPEC.md "Image"), as
 * cache_format/image_reader.py does: the header, sections, index and meta checked
 * at open; one entry found by bisecting the index, its blob read with pread
 * (never an mmap: a file truncated in place gives a short read, not SIGBUS),
 * checksummed, its zstd frame's declared size checked against the index
 * before anything is decompressed, decompressed with the image's dictionary
 * (loaded once, on the first read) and decoded as an entry.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_d_windowLogMax is stable API; this keeps older headers happy */
#include <zstd.h>

#include "lt_native.h"

static const ltn_mp_bounds META_BOUNDS = {4096, 0, 4096, 256, 0};

struct ltn_image {
    int fd;
    char *path;
    uint32_t codec, count;
    uint64_t size, data_start, data_end;
    uint8_t *index;        /* count records of 40 bytes */
    uint8_t *dict_section; /* the dictionary, one zstd frame (codec 2) */
    uint64_t dict_len;
    pthread_mutex_t lock;  /* guards the dictionary's load */
    int dict_state;        /* 0 not loaded, 1 loaded, -1 refused (dict_error says why) */
    ZSTD_DDict *ddict;
    char dict_error[LTN_ERROR_SIZE];
};

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

/* Exactly size bytes at offset into buf: LTN_OK, LTN_IO (a read error), LTN_DAMAGED (the file ends first). */
static int pread_all(const ltn_image *image, void *buf, uint64_t size, uint64_t offset, const char *what,
                     ltn_error *err) {
    uint8_t *out = buf;
    uint64_t done = 0;
    while (done < size) {
        size_t chunk = size - done > (1u << 30) ? (1u << 30) : (size_t)(size - done);
        ssize_t n = pread(image->fd, out + done, chunk, (off_t)(offset + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return ltn_fail(err, LTN_IO, "%s: reading %s: %s", image->path, what, strerror(errno));
        if (n == 0)
            return ltn_fail(err, LTN_DAMAGED, "%s: %s at [%llu, %llu) lies past the end of the file: it shrank "
                            "after it was opened (replace images by rename, not in place)", image->path, what,
                            (unsigned long long)offset, (unsigned long long)(offset + size));
        done += (uint64_t)n;
    }
    return LTN_OK;
}

static void *read_section(const ltn_image *image, uint64_t offset, uint64_t size, const char *what, int *status,
                          ltn_error *err) {
    uint8_t *buf = malloc(size ? (size_t)size : 1);
    if (buf == NULL) {
        *status = ltn_fail(err, LTN_NOMEM, "%s: cannot allocate %llu bytes for %s", image->path,
                           (unsigned long long)size, what);
        return NULL;
    }
    *status = pread_all(image, buf, size, offset, what, err);
    if (*status != LTN_OK) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* a + b == c without wrapping. */
static int sum_is(uint64_t a, uint64_t b, uint64_t c) { return a <= c && c - a == b; }

static int parse_header(ltn_image *image, const uint8_t *h, ltn_error *err) {
    const char *path = image->path;
    if (memcmp(h, "LTIMAGE\0", 8) != 0)
        return ltn_fail(err, LTN_DAMAGED, "%s: not an image (wrong magic)", path);
    if (le32(h + 8) != 1)
        return ltn_fail(err, LTN_DAMAGED, "%s: image format version %u is not 1", path, le32(h + 8));
    if (ltn_xxh3_64(h, 88) != le64(h + 88))
        return ltn_fail(err, LTN_DAMAGED, "%s: image header checksum mismatch", path);
    uint32_t codec = le32(h + 12), count = le32(h + 16), flags = le32(h + 20);
    uint64_t dict_off = le64(h + 24), dict_len = le64(h + 32), index_off = le64(h + 40), index_len = le64(h + 48);
    uint64_t meta_off = le64(h + 56), meta_len = le64(h + 64);
    if (codec > 2 || flags != 0 || (dict_len > 0) != (codec == 2))
        return ltn_fail(err, LTN_DAMAGED, "%s: codec %u, flags %u, dictionary of %llu bytes do not go together",
                        path, codec, flags, (unsigned long long)dict_len);
    int fits = dict_off == LTN_IMAGE_HEADER && dict_len <= LTN_MAX_DICT_BYTES &&
               index_len == (uint64_t)count * LTN_IMAGE_RECORD && dict_off + dict_len <= index_off &&
               sum_is(index_off, index_len, meta_off) && meta_len <= LTN_MAX_META_BYTES &&
               sum_is(meta_off, meta_len, image->size);
    if (!fits)
        return ltn_fail(err, LTN_DAMAGED, "%s: image sections do not fit the file (%llu bytes)", path,
                        (unsigned long long)image->size);
    if (count > LTN_MAX_IMAGE_ENTRIES)
        return ltn_fail(err, LTN_DAMAGED, "%s: image of %u entries exceeds this reader's bound of %u", path, count,
                        LTN_MAX_IMAGE_ENTRIES);
    int status;
    image->codec = codec;
    image->count = count;
    image->index = read_section(image, index_off, index_len, "the index", &status, err);
    if (image->index == NULL)
        return status;
    if (ltn_xxh3_64(image->index, (size_t)index_len) != le64(h + 72))
        return ltn_fail(err, LTN_DAMAGED, "%s: image index checksum mismatch", path);
    image->dict_section = read_section(image, dict_off, dict_len, "the dictionary", &status, err);
    if (image->dict_section == NULL)
        return status;
    image->dict_len = dict_len;
    uint8_t *meta = read_section(image, meta_off, meta_len, "the meta", &status, err);
    if (meta == NULL)
        return status;
    ltn_mp_type top = LTN_MP_NIL;
    const char *why = "";
    if (ltn_xxh3_64_pair(image->dict_section, (size_t)dict_len, meta, (size_t)meta_len) != le64(h + 80))
        status = ltn_fail(err, LTN_DAMAGED, "%s: image dictionary or meta checksum mismatch", path);
    else if (ltn_mp_check(meta, (size_t)meta_len, &META_BOUNDS, &top, &why) != 0)
        status = ltn_fail(err, LTN_DAMAGED, "%s: image meta is not valid msgpack: %s", path, why);
    else if (top != LTN_MP_MAP)
        status = ltn_fail(err, LTN_DAMAGED, "%s: image meta is not a map", path);
    free(meta);
    image->data_start = dict_off + dict_len;
    image->data_end = index_off;
    return status;
}

int ltn_image_open(const char *path, ltn_image **out, ltn_error *err) {
    *out = NULL;
    if (path == NULL)
        return ltn_fail(err, LTN_ARGUMENT, "image path is NULL");
    ltn_image *image = calloc(1, sizeof *image);
    if (image == NULL || (image->path = strdup(path)) == NULL) {
        free(image);
        return ltn_fail(err, LTN_NOMEM, "cannot allocate an image");
    }
    pthread_mutex_init(&image->lock, NULL);
    /* O_NONBLOCK: a FIFO or device named like an image cannot block the open; fstat then decides on the file
       actually opened. */
    image->fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (image->fd < 0) {
        int status = ltn_fail(err, LTN_IO, "%s: cannot open: %s", path, strerror(errno));
        ltn_image_close(image);
        return status;
    }
    struct stat st;
    int status = LTN_OK;
    uint8_t header[LTN_IMAGE_HEADER];
    if (fstat(image->fd, &st) != 0)
        status = ltn_fail(err, LTN_IO, "%s: cannot stat: %s", path, strerror(errno));
    else if (!S_ISREG(st.st_mode))
        status = ltn_fail(err, LTN_DAMAGED, "%s: not a regular file; an image must be one", path);
    else if ((image->size = (uint64_t)st.st_size) < LTN_IMAGE_HEADER)
        status = ltn_fail(err, LTN_DAMAGED, "%s: %llu bytes is too short for an image header", path,
                          (unsigned long long)image->size);
    else if ((status = pread_all(image, header, LTN_IMAGE_HEADER, 0, "the header", err)) == LTN_OK)
        status = parse_header(image, header, err);
    if (status != LTN_OK) {
        ltn_image_close(image);
        return status;
    }
    *out = image;
    return LTN_OK;
}

void ltn_image_close(ltn_image *image) {
    if (image == NULL)
        return;
    if (image->fd >= 0)
        close(image->fd);
    ZSTD_freeDDict(image->ddict);
    pthread_mutex_destroy(&image->lock);
    free(image->index);
    free(image->dict_section);
    free(image->path);
    free(image);
}

const char *ltn_image_path(const ltn_image *image) { return image->path; }
uint32_t ltn_image_count(const ltn_image *image) { return image->count; }
uint32_t ltn_image_codec(const ltn_image *image) { return image->codec; }

void ltn_image_key_at(const ltn_image *image, uint32_t i, char hex[33]) {
    static const char digits[] = "0123456789abcdef";
    const uint8_t *key = image->index + (size_t)i * LTN_IMAGE_RECORD;
    for (int k = 0; k < 16; k++) {
        hex[2 * k] = digits[key[k] >> 4];
        hex[2 * k + 1] = digits[key[k] & 15];
    }
    hex[32] = '\0';
}

uint32_t ltn_image_misordered(const ltn_image *image) {
    uint32_t bad = 0;
    for (uint32_t i = 1; i < image->count; i++)
        bad += memcmp(image->index + (size_t)i * LTN_IMAGE_RECORD,
                      image->index + (size_t)(i - 1) * LTN_IMAGE_RECORD, 16) <= 0;
    return bad;
}

static int key_bytes(const char *key, uint8_t raw[16], ltn_error *err) {
    if (key == NULL)
        return ltn_fail(err, LTN_ARGUMENT, "image key is NULL");
    for (int i = 0; i < 32; i++) {
        char c = key[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0)
            return ltn_fail(err, LTN_ARGUMENT, "image key must be 32 lowercase hex digits, got '%.64s'", key);
        raw[i / 2] = (uint8_t)(i % 2 ? raw[i / 2] | v : v << 4);
    }
    if (key[32] != '\0')
        return ltn_fail(err, LTN_ARGUMENT, "image key must be 32 lowercase hex digits, got '%.64s'", key);
    return LTN_OK;
}

/* The index record of raw (the first of equal keys, as the Python reader's bisection finds), or -1. */
static int64_t find(const ltn_image *image, const uint8_t raw[16]) {
    uint32_t lo = 0, hi = image->count;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (memcmp(image->index + (size_t)mid * LTN_IMAGE_RECORD, raw, 16) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < image->count && memcmp(image->index + (size_t)lo * LTN_IMAGE_RECORD, raw, 16) == 0)
        return lo;
    return -1;
}

int ltn_image_contains(const ltn_image *image, const char *key, ltn_error *err) {
    uint8_t raw[16];
    int status = key_bytes(key, raw, err);
    if (status != LTN_OK)
        return status;
    return find(image, raw) >= 0 ? LTN_OK : LTN_ABSENT;
}

/* The dictionary, decompressed from its section (bounded like an entry) on the first read; refused once,
   refused for good. Called under image->lock. */
static int load_dictionary(ltn_image *image, ltn_error *err) {
    if (image->dict_state == 1)
        return LTN_OK;
    if (image->dict_state == -1)
        return ltn_fail(err, LTN_DAMAGED, "%s", image->dict_error);
    unsigned long long claimed = ZSTD_getFrameContentSize(image->dict_section, (size_t)image->dict_len);
    size_t frame = ZSTD_findFrameCompressedSize(image->dict_section, (size_t)image->dict_len);
    const char *why = NULL;
    uint8_t *raw = NULL;
    if (claimed == ZSTD_CONTENTSIZE_ERROR || ZSTD_isError(frame))
        why = "not a zstd frame";
    else if (claimed == ZSTD_CONTENTSIZE_UNKNOWN || claimed == 0 || claimed > LTN_MAX_DICT_BYTES)
        why = "its frame claims a size outside [1, 16 MiB]";
    else if (frame != image->dict_len)
        why = "data after its frame";
    else if ((raw = malloc((size_t)claimed)) == NULL) {
        return ltn_fail(err, LTN_NOMEM, "%s: cannot allocate %llu bytes for the dictionary", image->path, claimed);
    } else {
        size_t n = ZSTD_decompress(raw, (size_t)claimed, image->dict_section, (size_t)image->dict_len);
        if (ZSTD_isError(n) || n != claimed)
            why = ZSTD_isError(n) ? ZSTD_getErrorName(n) : "it yields fewer bytes than its frame claims";
        else if ((image->ddict = ZSTD_createDDict(raw, (size_t)claimed)) == NULL)
            why = "zstd refuses its tables";
    }
    free(raw);
    if (why != NULL) {
        ltn_fail(err, LTN_DAMAGED, "%s: image dictionary is damaged: %s", image->path, why);
        memcpy(image->dict_error, err ? err->message : "image dictionary is damaged", sizeof image->dict_error);
        image->dict_error[sizeof image->dict_error - 1] = '\0';
        image->dict_state = -1;
        return LTN_DAMAGED;
    }
    image->dict_state = 1;
    return LTN_OK;
}

/* blob (a zstd frame) into raw_len bytes: the frame's declared size is checked before anything is allocated,
   no data may follow the frame, and the result is exactly raw_len bytes. */
static int decompress(ltn_image *image, const uint8_t *blob, size_t stored, size_t raw_len, const char *key,
                      uint8_t **out, ltn_error *err) {
    unsigned long long claimed = ZSTD_getFrameContentSize(blob, stored);
    if (claimed == ZSTD_CONTENTSIZE_ERROR)
        return ltn_fail(err, LTN_DAMAGED, "%s: entry %s is not a zstd frame", image->path, key);
    if (claimed != raw_len)
        return ltn_fail(err, LTN_DAMAGED, "%s: entry %s frame claims %lld bytes, index says %zu", image->path, key,
                        claimed == ZSTD_CONTENTSIZE_UNKNOWN ? -1LL : (long long)claimed, raw_len);
    size_t frame = ZSTD_findFrameCompressedSize(blob, stored);
    if (ZSTD_isError(frame) || frame != stored)
        return ltn_fail(err, LTN_DAMAGED, "%s: entry %s does not decompress: %s", image->path, key,
                        ZSTD_isError(frame) ? ZSTD_getErrorName(frame) : "data after its frame");
    if (image->codec == 2) {
        pthread_mutex_lock(&image->lock);
        int status = load_dictionary(image, err);
        pthread_mutex_unlock(&image->lock);
        if (status != LTN_OK)
            return status;
    }
    uint8_t *raw = malloc(raw_len);
    ZSTD_DCtx *dctx = ZSTD_createDCtx();
    if (raw == NULL || dctx == NULL) {
        free(raw);
        ZSTD_freeDCtx(dctx);
        return ltn_fail(err, LTN_NOMEM, "%s: cannot allocate %zu bytes for entry %s", image->path, raw_len, key);
    }
    size_t n = image->codec == 2 ? ZSTD_decompress_usingDDict(dctx, raw, raw_len, blob, stored, image->ddict)
                                 : ZSTD_decompressDCtx(dctx, raw, raw_len, blob, stored);
    ZSTD_freeDCtx(dctx);
    if (ZSTD_isError(n) || n != raw_len) {
        free(raw);
        return ltn_fail(err, LTN_DAMAGED, "%s: entry %s does not decompress: %s", image->path, key,
                        ZSTD_isError(n) ? ZSTD_getErrorName(n) : "fewer bytes than the index says");
    }
    *out = raw;
    return LTN_OK;
}

int ltn_image_read(ltn_image *image, const char *key, ltn_entry *out, ltn_error *err) {
    uint8_t raw_key[16];
    memset(out, 0, sizeof *out);
    int status = key_bytes(key, raw_key, err);
    if (status != LTN_OK)
        return status;
    int64_t i = find(image, raw_key);
    if (i < 0)
        return LTN_ABSENT;
    const uint8_t *record = image->index + (size_t)i * LTN_IMAGE_RECORD;
    uint64_t offset = le64(record + 16), checksum = le64(record + 32);
    uint32_t stored = le32(record + 24), raw_len = le32(record + 28);
    if (offset < image->data_start || offset > image->data_end || stored > image->data_end - offset)
        return ltn_fail(err, LTN_DAMAGED, "%s: entry %s at [%llu, %llu) lies outside the data section [%llu, %llu)",
                        image->path, key, (unsigned long long)offset, (unsigned long long)offset + stored,
                        (unsigned long long)image->data_start, (unsigned long long)image->data_end);
    if (raw_len < LTN_ENTRY_HEADER || raw_len > LTN_MAX_ENTRY_BYTES)
        return ltn_fail(err, LTN_DAMAGED, "%s: entry %s claims %u raw bytes, outside [%d, %u]", image->path, key,
                        raw_len, LTN_ENTRY_HEADER, LTN_MAX_ENTRY_BYTES);
    uint8_t *blob = read_section(image, offset, stored, "an entry", &status, err);
    if (blob == NULL)
        return status;
    if (ltn_xxh3_64(blob, stored) != checksum) {
        free(blob);
        return ltn_fail(err, LTN_DAMAGED, "%s: entry %s checksum mismatch", image->path, key);
    }
    uint8_t *data = blob;
    if (image->codec != 0) {
        status = decompress(image, blob, stored, raw_len, key, &data, err);
        free(blob);
        if (status != LTN_OK)
            return status;
    } else if (stored != raw_len) {
        free(blob);
        return ltn_fail(err, LTN_DAMAGED, "%s: entry %s is %u bytes, index says %u", image->path, key, stored,
                        raw_len);
    }
    ltn_error inner;
    status = ltn_entry_decode_owned(data, raw_len, key, out, &inner);
    if (status != LTN_OK)
        return ltn_fail(err, status, "%s: entry %s: %s", image->path, key, inner.message);
    return LTN_OK;
}
