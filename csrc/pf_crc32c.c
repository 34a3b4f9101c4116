/*
 * pf_crc32c.c — CRC32C (Castagnoli) of pool bytes, for SSD record checksums.
 *
 * Why CRC32C: it is what storage stacks use (iSCSI, ext4, NVMe PI), it
 * catches every burst error up to 32 bits, and x86 has an instruction for it
 * (SSE4.2 crc32, ~8 bytes per 3 cycles in one stream, several GB/s: more
 * than an SSD delivers, so one stream is enough and keeps this file short).
 * The SSE4.2 path is chosen once at load time by cpuid; elsewhere a
 * slicing-by-8 table does the same arithmetic. Both give identical results
 * (the standard reflected CRC32C: init ~0, final xor ~0, continued across
 * calls by passing the previous result).
 */
#define _GNU_SOURCE
#include "pf_internal.h"

#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <nmmintrin.h>
#endif

#define CRC32C_POLY_REFLECTED 0x82F63B78u

static uint32_t table[8][256];
static int have_sse42;

__attribute__((constructor)) static void crc32c_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (CRC32C_POLY_REFLECTED & (0u - (c & 1)));
    table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (__get_cpuid(1, &a, &b, &c, &d)) have_sse42 = (c & bit_SSE4_2) != 0;
#endif
}

static uint32_t crc_table(uint32_t crc, const uint8_t *p, uint64_t n) {
  while (n && ((uintptr_t)p & 7)) { crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff]; n--; }
  while (n >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    v ^= crc;
    crc = table[7][v & 0xff] ^ table[6][(v >> 8) & 0xff] ^ table[5][(v >> 16) & 0xff] ^
          table[4][(v >> 24) & 0xff] ^ table[3][(v >> 32) & 0xff] ^
          table[2][(v >> 40) & 0xff] ^ table[1][(v >> 48) & 0xff] ^ table[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t crc, const uint8_t *p,
                                                           uint64_t n) {
  uint64_t c = crc;
  while (n && ((uintptr_t)p & 7)) { c = _mm_crc32_u8((uint32_t)c, *p++); n--; }
  while (n >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
  return (uint32_t)c;
}
#endif

uint32_t pf_crc32c(uint32_t crc, const void *buf, uint64_t bytes) {
  crc = ~crc;
#if defined(__x86_64__)
  if (have_sse42) return ~crc_sse42(crc, buf, bytes);
#endif
  return ~crc_table(crc, buf, bytes);
}

/* ---- per-block checksums of pool ranges ------------------------------- */
/*
 * One call per batch of blocks (the peer tier's seal-time checksums, the
 * owner's lock answer, the requester's verification): block b covers the
 * next counts[b] extents, in payload order, and its CRC32C continues across
 * them, so two nodes whose allocators cut a block into different ranges
 * agree as long as the bytes in payload order agree. Unlike pf_pool_crc32c
 * there is no per-op iovec cap: a block of 80 layers × 8 ranks × K/V is
 * 1,280 extents when nothing merges.
 */
int32_t pf_pool_checksums(uint32_t pool, const void *exts, uint64_t num_exts,
                          const uint32_t *counts, uint32_t num_blocks, uint32_t *out_crcs) {
  pf_pool *p = pf_handle_get(pool, PF_K_POOL, "pf_pool_checksums");
  if (!p) return PF_EHANDLE;
  if (num_blocks == 0) return PF_OK;
  if (!exts || !counts || !out_crcs)
    return pf_fail(PF_EINVAL, "pf_pool_checksums: extents, counts or out_crcs is NULL");
  const pf_io_ext *x = exts;
  uint64_t need = 0;
  for (uint32_t b = 0; b < num_blocks; b++) need += counts[b];
  if (need != num_exts)
    return pf_fail(PF_EINVAL, "pf_pool_checksums: %u blocks name %llu extents, %llu given",
                   num_blocks, (unsigned long long)need, (unsigned long long)num_exts);
  for (uint64_t e = 0; e < num_exts; e++) {
    if (x[e].bytes == 0 || x[e].pool_off > p->bytes || x[e].bytes > p->bytes - x[e].pool_off)
      return pf_fail(PF_ERANGE, "pf_pool_checksums: extent %llu [%llu, +%llu) is empty or "
                     "outside the pool (%llu bytes)", (unsigned long long)e,
                     (unsigned long long)x[e].pool_off, (unsigned long long)x[e].bytes,
                     (unsigned long long)p->bytes);
  }
  atomic_fetch_add(&p->inflight, 1);
  uint64_t e = 0;
  for (uint32_t b = 0; b < num_blocks; b++) {
    uint32_t crc = 0;
    for (uint32_t k = 0; k < counts[b]; k++, e++)
      crc = pf_crc32c(crc, p->host + x[e].pool_off, x[e].bytes);
    out_crcs[b] = crc;
  }
  atomic_fetch_sub(&p->inflight, 1);
  return PF_OK;
}
