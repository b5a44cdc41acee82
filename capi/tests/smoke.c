/*
 * The C API on the emulated device, from C through include/rotkv.h: two sequences are
 * appended with the raw entry points (flush, tokens) and decoded in one batch (split-K
 * decode with 2 splits, then the merge), and the output is checked against values known
 * without rotkv:
 *
 * - sequence 0 holds 40 tokens (pages of 16, a 16-token window: most of them quantized
 *   to 2 bits) whose value rows are all the constant 0.5. Attention weights sum to one, so
 *   every output channel is 0.5 whatever the keys; a constant row quantizes without loss
 *   after the Hadamard rotation (it becomes one nonzero channel and zeros: codes 3 and 0),
 *   so only the f16 rounding of scales remains: within 2e-3.
 * - sequence 1 holds one token (an f16 sink): its output is its value row, within the f16
 *   storage of the rotated row (2e-3).
 *
 * The same tokens appended to a second layer in one batched append (a serving step:
 * both sequences' rows in one launch pair) must store the same bytes as the
 * per-sequence appends: pool, side stores and lengths equal.
 *
 * Then bad inputs: an unsupported head_dim and a misaligned pool are refused with a
 * status and a message. Built and run by `cargo xtask capi` (cc, librotkv_capi.a).
 */
#include "rotkv.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                  \
    do {                                                                             \
        RotkvStatus s_ = (call);                                                     \
        if (s_ != ROTKV_STATUS_OK) {                                                 \
            fprintf(stderr, "%s:%d: %s: status %d: %s\n", __FILE__, __LINE__, #call, \
                    (int)s_, rotkv_last_error());                                    \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

enum { D = 64, HQ = 4, HKV = 1, SPLITS = 2, LEN0 = 40, LEN1 = 1, BLOCKS_PER_SEQ = 4 };

static RotkvBuffer *upload(const RotkvDevice *dev, const void *src, size_t bytes) {
    RotkvBuffer *b = NULL;
    CHECK(rotkv_alloc(dev, bytes, &b));
    CHECK(rotkv_upload(dev, b, 0, src, bytes));
    return b;
}

static RotkvBuffer *zeros(const RotkvDevice *dev, size_t bytes) {
    RotkvBuffer *b = NULL;
    CHECK(rotkv_alloc(dev, bytes, &b));
    return b;
}

int main(void) {
    RotkvDevice *dev = rotkv_device_sim();
    RotkvConfig config;
    CHECK(rotkv_config_preset("k2v2", D, &config));
    config.page_size = 16;
    config.window = 16;
    config.sinks = 2;
    RotkvFormat format;
    uint32_t flags = 0;
    CHECK(rotkv_config_format(&config, &format, &flags));
    size_t pool_bytes = 0, side_elems = 0;
    CHECK(rotkv_layer_sizes(&config, HKV, 2 * BLOCKS_PER_SEQ, &pool_bytes, &side_elems));
    if (rotkv_pages_for(&format, LEN0) > BLOCKS_PER_SEQ) {
        fprintf(stderr, "the test's block tables are too short\n");
        return 1;
    }

    /* The layer: pool, side stores, tables, lengths, protected lists, identity calibration. */
    RotkvBuffer *pool = zeros(dev, pool_bytes);
    RotkvBuffer *sides = zeros(dev, 2 * side_elems * 2);
    uint32_t tables[2][BLOCKS_PER_SEQ] = {{0, 1, 2, 3}, {4, 5, 6, 7}};
    RotkvBuffer *tables_d = upload(dev, tables, sizeof tables);
    RotkvBuffer *lens_d = zeros(dev, 2 * sizeof(uint32_t));
    uint32_t protected_[2] = {UINT32_MAX, UINT32_MAX};
    RotkvBuffer *protected_d = upload(dev, protected_, sizeof protected_);
    float mean[HKV * D], scale[HKV * D];
    uint16_t perm[HKV * D];
    for (int i = 0; i < HKV * D; i++) {
        mean[i] = 0.0f;
        scale[i] = 1.0f;
        perm[i] = (uint16_t)(i % D);
    }
    RotkvBuffer *mean_d = upload(dev, mean, sizeof mean);
    RotkvBuffer *scale_d = upload(dev, scale, sizeof scale);
    RotkvBuffer *perm_d = upload(dev, perm, sizeof perm);

    /* Inputs: keys vary; sequence 0's values are constant, sequence 1's one row is not. */
    static float k[LEN0 * HKV * D], v0[LEN0 * HKV * D], v1[HKV * D];
    for (int i = 0; i < LEN0 * HKV * D; i++) {
        k[i] = sinf(0.37f * (float)i) + 0.1f * (float)(i % 7);
        v0[i] = 0.5f;
    }
    for (int i = 0; i < HKV * D; i++) v1[i] = cosf(0.21f * (float)i) - 0.25f;

    const uint32_t lens[2] = {LEN0, LEN1};
    const float *vs[2] = {v0, v1};
    for (int s = 0; s < 2; s++) {
        RotkvBuffer *k_d = upload(dev, k, lens[s] * HKV * D * sizeof(float));
        RotkvBuffer *v_d = upload(dev, vs[s], lens[s] * HKV * D * sizeof(float));
        uint64_t table = rotkv_buffer_addr(tables_d) + (uint64_t)s * BLOCKS_PER_SEQ * 4;
        uint64_t side = rotkv_buffer_addr(sides) + (uint64_t)s * side_elems * 2;
        RotkvAppendParams p = {
            .format = format,
            .num_kv_heads = HKV,
            .start = 0,
            .count = lens[s],
            .new_len = lens[s],
            .num_blocks = 2 * BLOCKS_PER_SEQ,
            .flags = flags,
            .token_stride = HKV * D,
            .v_token_stride = HKV * D,
            .head_stride = D,
            .input_dtype = ROTKV_DTYPE_F32,
        };
        RotkvFlushPtrs flush = {.block_table = table, .side = side, .pool = rotkv_buffer_addr(pool)};
        CHECK(rotkv_append_flush(dev, &p, &flush));
        RotkvAppendPtrs a = {
            .k = rotkv_buffer_addr(k_d),
            .v = rotkv_buffer_addr(v_d),
            .key_mean = rotkv_buffer_addr(mean_d),
            .key_scale = rotkv_buffer_addr(scale_d),
            .key_perm = rotkv_buffer_addr(perm_d),
            .value_perm = rotkv_buffer_addr(perm_d),
            .key_rot = rotkv_buffer_addr(scale_d),
            .value_rot = rotkv_buffer_addr(scale_d),
            .block_table = table,
            .protected_ = rotkv_buffer_addr(protected_d) + (uint64_t)s * 4,
            .pool = rotkv_buffer_addr(pool),
            .side = side,
            .seq_len = rotkv_buffer_addr(lens_d) + (uint64_t)s * 4,
        };
        CHECK(rotkv_append_tokens(dev, &p, &a));
        CHECK(rotkv_synchronize(dev));
        rotkv_buffer_free(k_d);
        rotkv_buffer_free(v_d);
    }
    uint32_t lens_back[2] = {0, 0};
    CHECK(rotkv_download(dev, lens_d, 0, lens_back, sizeof lens_back));
    if (lens_back[0] != LEN0 || lens_back[1] != LEN1) {
        fprintf(stderr, "device lengths %u %u, expected %u %u\n", lens_back[0], lens_back[1], LEN0, LEN1);
        return 1;
    }

    /* The same appends as one step batch into a second layer: the same bytes. */
    {
        enum { ROWS = LEN0 + LEN1, SEQS = 2 };
        RotkvBuffer *pool_b = zeros(dev, pool_bytes);
        RotkvBuffer *sides_b = zeros(dev, 2 * side_elems * 2);
        RotkvBuffer *lens_b = zeros(dev, 2 * sizeof(uint32_t));
        static float kb[ROWS * HKV * D], vb[ROWS * HKV * D];
        memcpy(kb, k, LEN0 * HKV * D * sizeof(float));
        memcpy(kb + LEN0 * HKV * D, k, LEN1 * HKV * D * sizeof(float));
        memcpy(vb, v0, LEN0 * HKV * D * sizeof(float));
        memcpy(vb + LEN0 * HKV * D, v1, LEN1 * HKV * D * sizeof(float));
        /* Each row's slot; then per slot its start, its count, its first row. */
        uint32_t meta[ROWS + 3 * SEQS];
        for (int r = 0; r < ROWS; r++) meta[r] = r < LEN0 ? 0 : 1;
        meta[ROWS + 0] = 0, meta[ROWS + 1] = 0;
        meta[ROWS + SEQS + 0] = LEN0, meta[ROWS + SEQS + 1] = LEN1;
        meta[ROWS + 2 * SEQS + 0] = 0, meta[ROWS + 2 * SEQS + 1] = LEN0;
        RotkvBuffer *kb_d = upload(dev, kb, sizeof kb), *vb_d = upload(dev, vb, sizeof vb);
        RotkvBuffer *meta_d = upload(dev, meta, sizeof meta), *errors_d = zeros(dev, 3 * sizeof(uint32_t));
        RotkvAppendBatchParams bp = {
            .append = {
                .format = format,
                .num_kv_heads = HKV,
                .start = 0,
                .count = 0,
                .new_len = 0,
                .num_blocks = 2 * BLOCKS_PER_SEQ,
                .flags = flags,
                .token_stride = HKV * D,
                .v_token_stride = HKV * D,
                .head_stride = D,
                .input_dtype = ROTKV_DTYPE_F32,
            },
            .max_seqs = SEQS,
            .max_rows = ROWS,
            .table_stride = BLOCKS_PER_SEQ,
            .protected_stride = 1,
        };
        RotkvBatchPtrs b = {
            .meta = rotkv_buffer_addr(meta_d),
            .k = rotkv_buffer_addr(kb_d),
            .v = rotkv_buffer_addr(vb_d),
            .key_mean = rotkv_buffer_addr(mean_d),
            .key_scale = rotkv_buffer_addr(scale_d),
            .key_perm = rotkv_buffer_addr(perm_d),
            .value_perm = rotkv_buffer_addr(perm_d),
            .key_rot = rotkv_buffer_addr(scale_d),
            .value_rot = rotkv_buffer_addr(scale_d),
            .tables = rotkv_buffer_addr(tables_d),
            .protected_ = rotkv_buffer_addr(protected_d),
            .pool = rotkv_buffer_addr(pool_b),
            .sides = rotkv_buffer_addr(sides_b),
            .lens = rotkv_buffer_addr(lens_b),
            .errors = rotkv_buffer_addr(errors_d),
        };
        CHECK(rotkv_append_batch(dev, &bp, &b));
        unsigned char *pa = malloc(pool_bytes), *pb = malloc(pool_bytes);
        unsigned char *sa = malloc(2 * side_elems * 2), *sb = malloc(2 * side_elems * 2);
        uint32_t lb[2], errs[3];
        CHECK(rotkv_download(dev, pool, 0, pa, pool_bytes));
        CHECK(rotkv_download(dev, pool_b, 0, pb, pool_bytes));
        CHECK(rotkv_download(dev, sides, 0, sa, 2 * side_elems * 2));
        CHECK(rotkv_download(dev, sides_b, 0, sb, 2 * side_elems * 2));
        CHECK(rotkv_download(dev, lens_b, 0, lb, sizeof lb));
        CHECK(rotkv_download(dev, errors_d, 0, errs, sizeof errs));
        size_t nonzero = 0;
        for (size_t i = 0; i < pool_bytes; i++) nonzero += pa[i] != 0;
        /* One quantized page of sequence 0: its key codes and scales (its value codes are
         * mostly 0, the rotated constant rows being zero but for one channel). */
        if (nonzero < 256) {
            fprintf(stderr, "the pool holds almost nothing (%zu nonzero bytes): no quantized page\n", nonzero);
            return 1;
        }
        int same = memcmp(pa, pb, pool_bytes) == 0 && memcmp(sa, sb, 2 * side_elems * 2) == 0;
        printf("batched append: pool and side stores %s the per-sequence appends', lengths %u %u, errors %u %u %u\n",
               same ? "equal" : "DIFFER FROM", lb[0], lb[1], errs[0], errs[1], errs[2]);
        if (!same || lb[0] != LEN0 || lb[1] != LEN1 || errs[0] || errs[1] || errs[2]) return 1;
        free(pa), free(pb), free(sa), free(sb);
        RotkvBuffer *tmp[] = {pool_b, sides_b, lens_b, kb_d, vb_d, meta_d, errors_d};
        for (size_t i = 0; i < sizeof tmp / sizeof tmp[0]; i++) rotkv_buffer_free(tmp[i]);
    }

    /* Decode both sequences (2 splits) and merge. */
    static float q[2 * HQ * D];
    for (int i = 0; i < 2 * HQ * D; i++) q[i] = sinf(0.11f * (float)i);
    RotkvBuffer *q_d = upload(dev, q, sizeof q);
    const size_t rows = 2 * HQ * SPLITS;
    RotkvBuffer *m_d = zeros(dev, rows * 4), *l_d = zeros(dev, rows * 4), *o_d = zeros(dev, rows * D * 4);
    RotkvBuffer *out_d = zeros(dev, 2 * HQ * D * 4);
    RotkvDecodeParams dp = {
        .format = format,
        .num_seqs = 2,
        .num_q_heads = HQ,
        .num_kv_heads = HKV,
        .num_splits = SPLITS,
        .block_table_stride = BLOCKS_PER_SEQ,
        .flags = flags,
        .sm_scale = 0.125f,
        .q_seq_stride = HQ * D,
        .q_token_stride = HQ * D,
        .q_dtype = ROTKV_DTYPE_F32,
        .num_blocks = 2 * BLOCKS_PER_SEQ,
        .max_len = LEN0,
        .q_len = 1,
        .attn_window = 0,
        .batch_rows = 0,
        .batch_seqs = 0,
    };
    RotkvDecodePtrs dptrs = {
        .q = rotkv_buffer_addr(q_d),
        .pool = rotkv_buffer_addr(pool),
        .tables = rotkv_buffer_addr(tables_d),
        .lens = rotkv_buffer_addr(lens_d),
        .sides = rotkv_buffer_addr(sides),
        .protected_ = rotkv_buffer_addr(protected_d),
        .key_scale = rotkv_buffer_addr(scale_d),
        .key_perm = rotkv_buffer_addr(perm_d),
        .key_rot = rotkv_buffer_addr(scale_d),
        .m = rotkv_buffer_addr(m_d),
        .l = rotkv_buffer_addr(l_d),
        .o = rotkv_buffer_addr(o_d),
        .meta = 0,
    };
    CHECK(rotkv_decode(dev, &dp, &dptrs));
    RotkvMergeParams mp = {
        .num_seqs = 2,
        .num_q_heads = HQ,
        .num_kv_heads = HKV,
        .head_dim = D,
        .num_splits = SPLITS,
        .flags = flags,
        .out_row_stride = HQ * D,
        .batch_seqs = 0,
        .q_len = 1,
    };
    RotkvMergePtrs mptrs = {
        .m = rotkv_buffer_addr(m_d),
        .l = rotkv_buffer_addr(l_d),
        .o = rotkv_buffer_addr(o_d),
        .vperm_inv = rotkv_buffer_addr(perm_d),
        .value_rot = rotkv_buffer_addr(scale_d),
        .out = rotkv_buffer_addr(out_d),
        .meta = 0,
    };
    CHECK(rotkv_merge(dev, &mp, &mptrs));
    static float out[2 * HQ * D];
    CHECK(rotkv_download(dev, out_d, 0, out, sizeof out));

    double worst0 = 0.0, worst1 = 0.0;
    for (int h = 0; h < HQ; h++) {
        for (int c = 0; c < D; c++) {
            worst0 = fmax(worst0, fabs(out[h * D + c] - 0.5));
            worst1 = fmax(worst1, fabs(out[(HQ + h) * D + c] - v1[c]));
        }
    }
    printf("sequence 0 (40 tokens, constant values): largest error %.2e\n", worst0);
    printf("sequence 1 (one token): largest error against its value row %.2e\n", worst1);
    if (!(worst0 < 2e-3) || !(worst1 < 2e-3)) {
        fprintf(stderr, "FAILED: decode output outside the bounds\n");
        return 1;
    }

    /* Bad inputs: a status and a message, nothing enqueued. */
    RotkvConfig bad = config;
    bad.head_dim = 96;
    RotkvStatus s = rotkv_config_format(&bad, &format, &flags);
    printf("head_dim 96: status %d: %s\n", (int)s, rotkv_last_error());
    if (s != ROTKV_STATUS_UNSUPPORTED || strstr(rotkv_last_error(), "head_dim 96") == NULL) return 1;
    dptrs.pool += 4;
    s = rotkv_decode(dev, &dp, &dptrs);
    printf("misaligned pool: status %d: %s\n", (int)s, rotkv_last_error());
    if (s != ROTKV_STATUS_SHAPE) return 1;
    s = rotkv_decode(dev, NULL, &dptrs);
    if (s != ROTKV_STATUS_SHAPE) return 1;
    /* KVarN normalization is not run by the device kernels: refused. */
    bad = config;
    bad.channel_norm = 1;
    s = rotkv_config_format(&bad, &format, &flags);
    printf("channel_norm 1: status %d: %s\n", (int)s, rotkv_last_error());
    if (s != ROTKV_STATUS_UNSUPPORTED) return 1;
    /* A format no configuration gives: no page count, no crash. */
    RotkvFormat junk = format;
    junk.page_size = 0;
    if (rotkv_pages_for(&junk, 1000) != 0) return 1;
    junk = format;
    junk.sinks = 0xffffffffu;
    junk.window = 2;
    if (rotkv_pages_for(&junk, 1000) != 0) return 1;
    /* A download of a range reads that range only; past the end is refused. */
    unsigned char piece[4], whole[16];
    CHECK(rotkv_download(dev, pool, 0, whole, sizeof whole));
    CHECK(rotkv_download(dev, pool, 8, piece, sizeof piece));
    if (memcmp(piece, whole + 8, sizeof piece) != 0) return 1;
    if (rotkv_download(dev, pool, (size_t)-2, piece, sizeof piece) != ROTKV_STATUS_SHAPE) return 1;

    RotkvBuffer *all[] = {pool, sides, tables_d, lens_d, protected_d, mean_d, scale_d, perm_d, q_d, m_d, l_d, o_d, out_d};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) rotkv_buffer_free(all[i]);
    rotkv_device_free(dev);
    printf("1 passed, 0 failed\n");
    return 0;
}
