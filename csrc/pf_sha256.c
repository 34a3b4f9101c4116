/*
 * pf_sha256.c — SHA-256 (FIPS 180-4) and the chained prefix block hashes an
 * engine computes for every prompt (python/pegaflow/hashes.py states the
 * formula; lib/client/hashes.ts and hashlib compute the same bytes).
 *
 * Why here: a warm request's TTFT clock starts before its prompt is hashed,
 * and hashlib spends ~1 µs of interpreter and OpenSSL set-up per 80-byte
 * block (0.75 ms for a 10K-token prompt of 640 blocks), where the
 * compression itself is ~0.1 µs. One call hashes the whole chain.
 *
 * Two ways to compute the same compression, chosen once at load time by
 * cpuid: the SHA extensions (sha256rnds2/msg1/msg2, on every x86 server CPU
 * since Zen 1 and Ice Lake) and portable C elsewhere.
 */
#define _GNU_SOURCE
#include "pf_internal.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "pf_chain_hashes reads token ids as little-endian u32 in place"
#endif

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

/* The compression of `nblocks` consecutive 64-byte blocks into the state. */
typedef void (*compress_fn)(uint32_t st[8], const uint8_t *data, uint64_t nblocks);

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static uint32_t load_be32(const uint8_t *p) {
  return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void compress_portable(uint32_t st[8], const uint8_t *data, uint64_t nblocks) {
  for (; nblocks; nblocks--, data += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++) w[i] = load_be32(data + 4 * i);
    for (int i = 16; i < 64; i++) {
      uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = st[0], b = st[1], c = st[2], d = st[3];
    uint32_t e = st[4], f = st[5], g = st[6], h = st[7];
    for (int i = 0; i < 64; i++) {
      uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
      uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    st[0] += a;
    st[1] += b;
    st[2] += c;
    st[3] += d;
    st[4] += e;
    st[5] += f;
    st[6] += g;
    st[7] += h;
  }
}

#if defined(__x86_64__)
/* The SHA extensions keep the state as two lanes, ABEF and CDGH; each
 * sha256rnds2 does two rounds, each group of four message words is
 * scheduled from the four before it (msg1, the alignr'd w[i-7], msg2). */
__attribute__((target("sha,sse4.1,ssse3"))) static void compress_shani(uint32_t st[8],
                                                                        const uint8_t *data,
                                                                        uint64_t nblocks) {
  const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
  __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&st[0]), 0xB1); /* CDAB */
  __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&st[4]), 0x1B);  /* EFGH */
  __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);                                         /* ABEF */
  s1 = _mm_blend_epi16(s1, tmp, 0xF0);                                              /* CDGH */
  for (; nblocks; nblocks--, data += 64) {
    const __m128i abef = s0, cdgh = s1;
    __m128i m[4];
    for (int g = 0; g < 16; g++) {
      __m128i w;
      if (g < 4) {
        w = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16 * g)), bswap);
      } else {
        /* m[g & 3] holds w[g-4]; m[(g+1)&3] w[g-3]; m[(g+2)&3] w[g-2]; m[(g+3)&3] w[g-1]. */
        w = _mm_sha256msg1_epu32(m[g & 3], m[(g + 1) & 3]);
        w = _mm_add_epi32(w, _mm_alignr_epi8(m[(g + 3) & 3], m[(g + 2) & 3], 4));
        w = _mm_sha256msg2_epu32(w, m[(g + 3) & 3]);
      }
      m[g & 3] = w;
      __m128i msg = _mm_add_epi32(w, _mm_loadu_si128((const __m128i *)&K[4 * g]));
      s1 = _mm_sha256rnds2_epu32(s1, s0, msg);
      s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(msg, 0x0E));
    }
    s0 = _mm_add_epi32(s0, abef);
    s1 = _mm_add_epi32(s1, cdgh);
  }
  tmp = _mm_shuffle_epi32(s0, 0x1B);                /* FEBA */
  s1 = _mm_shuffle_epi32(s1, 0xB1);                 /* DCHG */
  s0 = _mm_blend_epi16(tmp, s1, 0xF0);              /* DCBA */
  s1 = _mm_alignr_epi8(s1, tmp, 8);                 /* HGFE */
  _mm_storeu_si128((__m128i *)&st[0], s0);
  _mm_storeu_si128((__m128i *)&st[4], s1);
}
#endif

static compress_fn compress = compress_portable;
static const char *impl_name = "portable";

__attribute__((constructor)) static void sha256_init(void) {
  /* PF_SHA256=portable forces the C path (tests compare the two). */
  const char *force = getenv("PF_SHA256");
  if (force && strcmp(force, "portable") == 0) return;
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return;
  int base = (c & bit_SSSE3) && (c & bit_SSE4_1);
  if (base && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_SHA)) {
    compress = compress_shani;
    impl_name = "sha-ni";
  }
#endif
}

/* sha256(a || b): a streaming hash of two pieces, whole 64-byte blocks
 * straight from `b` (no copy of the message). */
static void sha256_two(const uint8_t *a, uint64_t na, const uint8_t *b, uint64_t nb,
                       uint8_t out[32]) {
  uint32_t st[8];
  uint8_t buf[128];
  memcpy(st, H0, sizeof st);
  const uint64_t total = na + nb;
  /* `a` is at most 32 bytes (a parent hash): it only ever starts the first block. */
  if (na) memcpy(buf, a, na);
  uint64_t fill = na;
  uint64_t take = 64 - fill < nb ? 64 - fill : nb;
  memcpy(buf + fill, b, take);
  fill += take;
  b += take;
  nb -= take;
  if (fill == 64) {
    compress(st, buf, 1);
    fill = 0;
    if (nb >= 64) {
      compress(st, b, nb / 64);
      b += nb & ~(uint64_t)63;
      nb &= 63;
    }
    memcpy(buf, b, nb);
    fill = nb;
  }
  /* Padding: 0x80, zeros, the bit length big-endian in the last 8 bytes. */
  buf[fill++] = 0x80;
  uint64_t end = fill <= 56 ? 64 : 128;
  memset(buf + fill, 0, end - fill);
  const uint64_t bits = total * 8;
  for (int i = 0; i < 8; i++) buf[end - 1 - i] = (uint8_t)(bits >> (8 * i));
  compress(st, buf, end / 64);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (uint8_t)(st[i] >> 24);
    out[4 * i + 1] = (uint8_t)(st[i] >> 16);
    out[4 * i + 2] = (uint8_t)(st[i] >> 8);
    out[4 * i + 3] = (uint8_t)st[i];
  }
}

int32_t pf_chain_hashes(const uint32_t *tokens, uint64_t num_blocks, uint32_t block_tokens,
                        const uint8_t *parent, uint32_t hash_bytes, uint8_t *out) {
  if (hash_bytes < 1 || hash_bytes > 32)
    return pf_fail(PF_EINVAL, "pf_chain_hashes: hash_bytes %u outside 1..32", hash_bytes);
  if (block_tokens < 1)
    return pf_fail(PF_EINVAL, "pf_chain_hashes: block_tokens must be >= 1, got 0");
  if (!parent || !out || (num_blocks && !tokens))
    return pf_fail(PF_EINVAL, "pf_chain_hashes: null %s",
                   !parent ? "parent" : !out ? "out" : "tokens");
  const uint64_t step = (uint64_t)block_tokens * 4;
  const uint8_t *prev = parent;
  uint8_t digest[32];
  for (uint64_t i = 0; i < num_blocks; i++) {
    sha256_two(prev, hash_bytes, (const uint8_t *)tokens + i * step, step, digest);
    memcpy(out + i * hash_bytes, digest, hash_bytes);
    prev = out + i * hash_bytes;
  }
  return 0;
}

const char *pf_sha256_impl(void) { return impl_name; }
