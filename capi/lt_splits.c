/*
 * lt_splits.c: the split count of a decoding call, the C twin of kernels/flash_decode/binding.py's
 * choose_splits and splits_for (FlashAttention-2's heuristic). Pure: no dependency but <stdint.h>, so
 * tests/test_capi_kvcache.py compiles it alone and compares it with the Python functions over a grid.
 * Included by lt_kvcache.c.
 */
#include <stdint.h>

#define LT__MAX_HEURISTIC_SPLITS 128

static int64_t lt__ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static double lt__ceil(double x) {
    double t = (double)(int64_t)x;
    return t < x ? t + 1.0 : t;
}

/* choose_splits: how many splits fill `sms` program slots evenly (as binding.choose_splits). One pass over the
 * counts keeps each eligible count's efficiency (a count whose blocks per split differ from the previous
 * count's), then the smallest within 85% of the best wins: the same expressions as the Python function's. */
static int64_t lt__choose_splits(int64_t programs, int64_t key_blocks, int64_t sms) {
    if (programs <= 0 || key_blocks <= 1 || (double)programs >= 0.8 * (double)sms)
        return 1;
    int64_t limit = LT__MAX_HEURISTIC_SPLITS;
    limit = sms < limit ? sms : limit;
    limit = key_blocks < limit ? key_blocks : limit;
    double efficiency[LT__MAX_HEURISTIC_SPLITS + 1], best = 0.0;
    int64_t previous = 0;
    for (int64_t n = 1; n <= limit; n++) {
        int64_t per_split = lt__ceil_div(key_blocks, n);
        efficiency[n] = -1.0; /* not eligible */
        if (n == 1 || per_split != previous) {
            double waves = (double)(programs * n) / (double)sms;
            efficiency[n] = waves / lt__ceil(waves);
            best = efficiency[n] > best ? efficiency[n] : best;
        }
        previous = per_split;
    }
    for (int64_t n = 1; n <= limit; n++)
        if (efficiency[n] >= 0.85 * best)
            return n;
    return 1;
}

/* split_grid's query-row blocks a batch entry (kernels/flash_decode's split_grid, one split): rows / block_m;
 * packed_rows >= 0 (queries packed by cu_seqlens_q: group x total_q): the sequences' row blocks flattened,
 * packed_rows / block_m + batch of them, each batch entry (grid z) taking an even share. */
static int64_t lt__split_row_blocks(int64_t rows, int64_t block_m, int64_t batch, int64_t packed_rows) {
    if (packed_rows < 0)
        return lt__ceil_div(rows, block_m);
    return lt__ceil_div(packed_rows / block_m + batch, batch > 1 ? batch : 1);
}

/* splits_for: the forced count, else the heuristic over the keys one row block can see (a window or a chunk
 * bounds them), in units of
 * max(block_n, min_keys); at most as many as keep the partials (n_rows of head_dim each: batch x heads_q x
 * seqlen_q, or heads_q x total_q for packed queries) under 2**31 elements. packed_rows: -1, or for packed
 * queries group x total_q (lt__split_row_blocks). */
static int64_t lt__splits_for(int64_t batch, int64_t heads_q, int64_t heads_k, int64_t seqlen_q, int64_t head_dim,
                              int64_t capacity, int64_t window_left, int64_t window_right, int64_t chunk,
                              int64_t forced,
                              int64_t block_m, int64_t block_n, int64_t slots, int64_t min_keys, int64_t n_rows,
                              int64_t packed_rows) {
    int64_t size = n_rows * head_dim;
    int64_t most = INT32_MAX / (size > 1 ? size : 1);
    most = most > 1 ? most : 1;
    if (forced > 0)
        return forced < most ? forced : most;
    int64_t rows = heads_q / heads_k * seqlen_q;
    int64_t programs = batch * heads_k * lt__split_row_blocks(rows, block_m, batch, packed_rows);
    int64_t keys = capacity;
    if (window_left >= 0 && window_left + window_right + seqlen_q < keys)
        keys = window_left + window_right + seqlen_q;
    if (chunk > 0 && chunk + seqlen_q < keys)
        keys = chunk + seqlen_q;
    int64_t unit = block_n > min_keys ? block_n : min_keys;
    int64_t n = lt__choose_splits(programs, lt__ceil_div(keys, unit), slots);
    return n < most ? n : most;
}
