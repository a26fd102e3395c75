/* AES-XTS over runs of sectors, one data unit per sector, tweak = 8 zero bytes then the LBA as
 * a little-endian u64 (SPDK crypto vbdev, SIMPLE_LBA). Compiled by _build.py through cffi.
 *
 * Two implementations behind one handle:
 *  - EVP: OpenSSL's EVP interface, one context per handle; the tweak is written straight into
 *    the context's IV (EVP_CIPHER_CTX_iv_noconst), which XTS reads on every EVP_CipherUpdate,
 *    where a per-sector EVP_CipherInit_ex halves throughput on 4 KiB sectors. Portable (Arm).
 *  - VAES: AVX-512 VAES, 32 blocks per loop step, chosen at run time when the CPU has it. The
 *    system OpenSSL 3.0 has no VAES XTS code, so without this path a sector loop reaches only
 *    about 0.65 of what the `cryptography` wheel's newer OpenSSL does in one call.
 * Sectors are multiples of 512 bytes (power-of-two blocks >= 512): no ciphertext stealing.
 *
 * dpukv_xts_run_xxh3 fuses the chunk checksum (xxh3-128, the real xxHash from Debian's
 * libxxhash-dev, inlined: nothing new at run time) into the cipher pass: the plaintext is hashed
 * while it is in cache (after decrypting, before encrypting), in groups of sectors that fit in
 * L2, instead of a second pass over buffers that do not fit in cache.
 *
 * dpukv_xts_run_mapped runs either of them over a source that is a file's memory mapping (the
 * NVMe tier's page cache): a page the kernel cannot supply (an I/O error, a file cut short
 * under the mapping) raises SIGBUS in the reading thread; the guard turns it into a return
 * code, so the caller reads that range again with preadv and reports its error.
 */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <openssl/evp.h>
#define XXH_INLINE_ALL /* header-only: the build needs xxhash.h (libxxhash-dev), not the .so */
#include <xxhash.h>

/* Build with -DDPUKV_NO_VAES (env DPUKV_XTS_NO_VAES=1 for _build.py) for the EVP loop only. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(DPUKV_NO_VAES)
#define DPUKV_HAVE_X86 1
#include <immintrin.h>
#endif

#define DPUKV_IMPL_EVP 1
#define DPUKV_IMPL_VAES 2

typedef struct dpukv_xts {
    int impl;
    int encrypt;
    int rounds;                 /* 10 (AES-128) or 14 (AES-256) */
    unsigned char rk1[15][16];  /* data key schedule: encryption, or decryption (aesimc'd) */
    unsigned char rk2[15][16];  /* tweak key schedule (always encryption) */
    EVP_CIPHER_CTX *ctx;
    unsigned char *iv;          /* OpenSSL's IV inside ctx, or NULL: reset per sector */
} dpukv_xts;

static void lba_tweak(unsigned char out[16], uint64_t lba)
{
    memset(out, 0, 8);
    for (int b = 0; b < 8; b++) out[8 + b] = (unsigned char)(lba >> (8 * b));
}

/* ---------------------------------------------------------------- EVP ---------------------- */

static int evp_init(dpukv_xts *h, const unsigned char *key, size_t key_len)
{
    const EVP_CIPHER *cipher = key_len == 64 ? EVP_aes_256_xts() : EVP_aes_128_xts();
    unsigned char iv[16] = {0};
    h->ctx = EVP_CIPHER_CTX_new();
    if (h->ctx == NULL) return -1;
    if (EVP_CipherInit_ex(h->ctx, cipher, NULL, key, iv, h->encrypt) != 1) return -1;
    h->iv = EVP_CIPHER_CTX_iv_noconst(h->ctx);
    return 0;
}

static int evp_run(dpukv_xts *h, const unsigned char *src, unsigned char *dst,
                   size_t sector_bytes, size_t sector_count, uint64_t first_lba)
{
    unsigned char tweak[16];
    unsigned char *iv = h->iv != NULL ? h->iv : tweak;
    for (size_t i = 0; i < sector_count; i++) {
        int out_len = 0;
        size_t off = i * sector_bytes;
        lba_tweak(iv, first_lba + i);
        if (h->iv == NULL && EVP_CipherInit_ex(h->ctx, NULL, NULL, NULL, tweak, -1) != 1)
            return -(int)(i + 1);
        if (EVP_CipherUpdate(h->ctx, dst + off, &out_len, src + off, (int)sector_bytes) != 1
            || (size_t)out_len != sector_bytes)
            return -(int)(i + 1);
    }
    return 0;
}

/* ---------------------------------------------------------------- VAES --------------------- */
#ifdef DPUKV_HAVE_X86
#define AESNI __attribute__((target("aes,sse4.1")))
#define VAES512 __attribute__((target("avx512f,avx512bw,vaes,vpclmulqdq,aes,sse4.1")))

AESNI static __m128i expand_step(__m128i key, __m128i assist)
{
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    return _mm_xor_si128(key, assist);
}

/* Encryption key schedule (FIPS-197), AES-NI as in Intel's AES-NI white paper. */
AESNI static void expand_key(const unsigned char *key, int rounds, unsigned char rk[15][16])
{
    __m128i k[15];
    k[0] = _mm_loadu_si128((const __m128i *)key);
    if (rounds == 10) {
#define E128(i, rcon) k[i] = expand_step(k[i - 1], \
        _mm_shuffle_epi32(_mm_aeskeygenassist_si128(k[i - 1], rcon), 0xff))
        E128(1, 0x01); E128(2, 0x02); E128(3, 0x04); E128(4, 0x08); E128(5, 0x10);
        E128(6, 0x20); E128(7, 0x40); E128(8, 0x80); E128(9, 0x1b); E128(10, 0x36);
#undef E128
    } else {
        k[1] = _mm_loadu_si128((const __m128i *)(key + 16));
#define E256A(i, rcon) k[i] = expand_step(k[i - 2], \
        _mm_shuffle_epi32(_mm_aeskeygenassist_si128(k[i - 1], rcon), 0xff))
#define E256B(i) k[i] = expand_step(k[i - 2], \
        _mm_shuffle_epi32(_mm_aeskeygenassist_si128(k[i - 1], 0x00), 0xaa))
        E256A(2, 0x01); E256B(3); E256A(4, 0x02); E256B(5); E256A(6, 0x04); E256B(7);
        E256A(8, 0x08); E256B(9); E256A(10, 0x10); E256B(11); E256A(12, 0x20); E256B(13);
        E256A(14, 0x40);
#undef E256A
#undef E256B
    }
    for (int i = 0; i <= rounds; i++) _mm_storeu_si128((__m128i *)rk[i], k[i]);
}

/* Equivalent inverse cipher: reverse order, InvMixColumns on the middle round keys. */
AESNI static void invert_key(int rounds, unsigned char rk[15][16])
{
    __m128i k[15];
    memset(k, 0, sizeof(k));
    for (int i = 0; i <= rounds; i++) k[i] = _mm_loadu_si128((const __m128i *)rk[i]);
    _mm_storeu_si128((__m128i *)rk[0], k[rounds]);
    for (int i = 1; i < rounds; i++)
        _mm_storeu_si128((__m128i *)rk[i], _mm_aesimc_si128(k[rounds - i]));
    _mm_storeu_si128((__m128i *)rk[rounds], k[0]);
}

AESNI static __m128i encrypt_block(const dpukv_xts *h, __m128i x)
{
    x = _mm_xor_si128(x, _mm_loadu_si128((const __m128i *)h->rk2[0]));
    for (int r = 1; r < h->rounds; r++)
        x = _mm_aesenc_si128(x, _mm_loadu_si128((const __m128i *)h->rk2[r]));
    return _mm_aesenclast_si128(x, _mm_loadu_si128((const __m128i *)h->rk2[h->rounds]));
}

/* Multiply each 128-bit lane (little-endian) by x^k in GF(2^128) mod x^128+x^7+x^2+x+1,
   1 <= k <= 8: shift left by k; the k bits shifted out of bit 127 come back as t*0x87. */
#define MUL_XK(T, K) ({                                                                     \
    __m512i carry_ = _mm512_shuffle_epi32(_mm512_srli_epi64((T), 64 - (K)), _MM_PERM_BADC); \
    __m512i red_ = _mm512_xor_si512(                                                        \
        _mm512_xor_si512(carry_, _mm512_slli_epi64(carry_, 1)),                            \
        _mm512_xor_si512(_mm512_slli_epi64(carry_, 2), _mm512_slli_epi64(carry_, 7)));     \
    _mm512_xor_si512(_mm512_slli_epi64((T), (K)),                                          \
                     _mm512_mask_blend_epi64(0x55, carry_, red_));                         \
})

/* Each lane times x^8: a byte shift, and the byte shifted out comes back as byte*0x87 (a
   carry-less product). Byte shifts and VPCLMULQDQ run on another port than VAESENC, so the
   tweaks cost the AES rounds almost nothing (the bit shifts of MUL_XK would compete). */
#define MUL_X8(T) ({                                                                        \
    __m512i top_ = _mm512_bsrli_epi128((T), 15);                                           \
    _mm512_xor_si512(_mm512_bslli_epi128((T), 1),                                          \
                     _mm512_clmulepi64_epi128(top_, _mm512_set1_epi64(0x87), 0x00));       \
})

/* Lanes T, T*x, T*x^2, T*x^3 from the 128-bit start tweak T. */
VAES512 static __m512i first_tweaks(__m128i t0)
{
    __m512i t = _mm512_broadcast_i32x4(t0);
    __m512i t1 = MUL_XK(t, 1), t2 = MUL_XK(t, 2), t3 = MUL_XK(t, 3);
    t = _mm512_mask_blend_epi64(0x0c, t, t1);   /* lane 1 */
    t = _mm512_mask_blend_epi64(0x30, t, t2);   /* lane 2 */
    return _mm512_mask_blend_epi64(0xc0, t, t3); /* lane 3 */
}

/* Eight independent 4-block streams: VAES latency is covered, and 8 data plus 8 tweak
   registers leave room for the 15 round keys in AVX-512's 32 registers. */
#define ROUNDS8(OP, K) do {                                                                 \
    __m512i k_ = (K);                                                                       \
    b[0] = OP(b[0], k_); b[1] = OP(b[1], k_); b[2] = OP(b[2], k_); b[3] = OP(b[3], k_);     \
    b[4] = OP(b[4], k_); b[5] = OP(b[5], k_); b[6] = OP(b[6], k_); b[7] = OP(b[7], k_);     \
} while (0)

/* tw[j] holds the tweaks of blocks 4j..4j+3 of the current 512 bytes, so tw[j] = tw[j-2]*x^8. */
VAES512 static void vaes_sector(const dpukv_xts *h, const __m512i *rk, const unsigned char *src,
                                unsigned char *dst, size_t sector_bytes, uint64_t lba)
{
    unsigned char iv[16];
    lba_tweak(iv, lba);
    __m512i tw[8], b[8];
    tw[0] = first_tweaks(encrypt_block(h, _mm_loadu_si128((const __m128i *)iv)));
    tw[1] = MUL_XK(tw[0], 4);
    const int rounds = h->rounds;
    for (size_t off = 0; off < sector_bytes; off += 512) {
#pragma GCC unroll 8
        for (int j = 2; j < 8; j++) tw[j] = MUL_X8(tw[j - 2]);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            b[j] = _mm512_xor_si512(_mm512_loadu_si512(src + off + 64 * j), tw[j]);
        ROUNDS8(_mm512_xor_si512, rk[0]);
        if (h->encrypt) {
            for (int r = 1; r < rounds; r++) ROUNDS8(_mm512_aesenc_epi128, rk[r]);
            ROUNDS8(_mm512_aesenclast_epi128, rk[rounds]);
        } else {
            for (int r = 1; r < rounds; r++) ROUNDS8(_mm512_aesdec_epi128, rk[r]);
            ROUNDS8(_mm512_aesdeclast_epi128, rk[rounds]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            _mm512_storeu_si512(dst + off + 64 * j, _mm512_xor_si512(b[j], tw[j]));
        tw[0] = MUL_X8(tw[6]);
        tw[1] = MUL_X8(tw[7]);
    }
}

VAES512 static int vaes_run(dpukv_xts *h, const unsigned char *src, unsigned char *dst,
                            size_t sector_bytes, size_t sector_count, uint64_t first_lba)
{
    __m512i rk[15];
    if (sector_bytes % 512 != 0) return -1;
    for (int r = 0; r <= h->rounds; r++)
        rk[r] = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)h->rk1[r]));
    for (size_t i = 0; i < sector_count; i++)
        vaes_sector(h, rk, src + i * sector_bytes, dst + i * sector_bytes, sector_bytes,
                    first_lba + i);
    return 0;
}

static int vaes_available(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("vaes") && __builtin_cpu_supports("vpclmulqdq")
        && __builtin_cpu_supports("aes");
}

static void vaes_init(dpukv_xts *h, const unsigned char *key, size_t key_len)
{
    size_t half = key_len / 2;
    expand_key(key, h->rounds, h->rk1);
    if (!h->encrypt) invert_key(h->rounds, h->rk1);
    expand_key(key + half, h->rounds, h->rk2);
}
#endif /* DPUKV_HAVE_X86 */

/* ---------------------------------------------------------------- API ---------------------- */

#ifndef DPUKV_SOURCE_DIGEST
#define DPUKV_SOURCE_DIGEST "unknown"
#endif

/* The digest _build.py computed over this file and the cffi declarations. */
const char *dpukv_xts_source_digest(void) { return DPUKV_SOURCE_DIGEST; }

/* Which implementation a new handle gets when allowed to choose: DPUKV_IMPL_*. */
int dpukv_xts_best_impl(void)
{
#ifdef DPUKV_HAVE_X86
    if (vaes_available()) return DPUKV_IMPL_VAES;
#endif
    return DPUKV_IMPL_EVP;
}

/* key = key1 || key2: 32 bytes (AES-128-XTS) or 64 (AES-256-XTS); impl 0 = best available.
   NULL on failure (bad length, unavailable impl, OpenSSL error). */
dpukv_xts *dpukv_xts_new(const unsigned char *key, size_t key_len, int encrypt, int impl)
{
    if (key_len != 32 && key_len != 64) return NULL;
    if (impl == 0) impl = dpukv_xts_best_impl();
    if (impl != DPUKV_IMPL_EVP && impl != dpukv_xts_best_impl()) return NULL;
    dpukv_xts *h = (dpukv_xts *)calloc(1, sizeof(*h));
    if (h == NULL) return NULL;
    h->impl = impl;
    h->encrypt = encrypt ? 1 : 0;
    h->rounds = key_len == 64 ? 14 : 10;
    if (impl == DPUKV_IMPL_EVP) {
        if (evp_init(h, key, key_len) != 0) {
            EVP_CIPHER_CTX_free(h->ctx);
            free(h);
            return NULL;
        }
    }
#ifdef DPUKV_HAVE_X86
    else {
        vaes_init(h, key, key_len);
    }
#endif
    return h;
}

int dpukv_xts_impl(const dpukv_xts *h) { return h->impl; }

void dpukv_xts_free(dpukv_xts *h)
{
    if (h == NULL) return;
    EVP_CIPHER_CTX_free(h->ctx);
    OPENSSL_cleanse(h, sizeof(*h));
    free(h);
}

/* src == dst is allowed. Returns 0; 1 when src and dst overlap without being equal (checked
   here, where it costs nothing, rather than in Python); or -(index+1) of a failed sector. */
int dpukv_xts_run(dpukv_xts *h, const unsigned char *src, unsigned char *dst,
                  size_t sector_bytes, size_t sector_count, uint64_t first_lba)
{
    uintptr_t s = (uintptr_t)src, d = (uintptr_t)dst, n = sector_bytes * sector_count;
    if (s != d && s < d + n && d < s + n) return 1;
#ifdef DPUKV_HAVE_X86
    if (h->impl == DPUKV_IMPL_VAES)
        return vaes_run(h, src, dst, sector_bytes, sector_count, first_lba);
#endif
    return evp_run(h, src, dst, sector_bytes, sector_count, first_lba);
}

/* ---------------------------------------------------------------- xxh3-128 ----------------- */

/* The update loop by vector width: the portable inlined one (SSE2 on x86-64, NEON on Arm), or
   xxh3_avx2.c / xxh3_avx512.c where the CPU has them. Digests are identical across variants. */
#define DPUKV_XXH3_PORTABLE 1
#define DPUKV_XXH3_AVX2 2
#define DPUKV_XXH3_AVX512 3
typedef void (*xxh3_update_fn)(void *state, const void *data, size_t len);

static void xxh3_update_portable(void *state, const void *data, size_t len)
{
    XXH3_128bits_update((XXH3_state_t *)state, data, len);
}

#if defined(__x86_64__) && defined(__GNUC__)
void dpukv_xxh3_update_avx2(void *state, const void *data, size_t len);
void dpukv_xxh3_update_avx512(void *state, const void *data, size_t len);
#endif

static int xxh3_variant_best(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return DPUKV_XXH3_AVX512;
    if (__builtin_cpu_supports("avx2")) return DPUKV_XXH3_AVX2;
#endif
    return DPUKV_XXH3_PORTABLE;
}

static int xxh3_variant;  /* 0 until first use; a benign race: every thread stores the same */
static xxh3_update_fn xxh3_update = xxh3_update_portable;

/* Use `variant` (DPUKV_XXH3_*; 0 = the best this CPU runs) from now on: tests compare them.
   Returns the variant in use; a variant the CPU lacks is refused (the one in use stays). */
int dpukv_xxh3_set_variant(int variant)
{
    int best = xxh3_variant_best();
    if (variant == 0) variant = best;
    if (variant < DPUKV_XXH3_PORTABLE || variant > best)
        return xxh3_variant ? xxh3_variant : dpukv_xxh3_set_variant(0);
#if defined(__x86_64__) && defined(__GNUC__)
    xxh3_update = variant == DPUKV_XXH3_AVX512 ? dpukv_xxh3_update_avx512
                : variant == DPUKV_XXH3_AVX2 ? dpukv_xxh3_update_avx2 : xxh3_update_portable;
#endif
    xxh3_variant = variant;
    return variant;
}

/* A streaming xxh3-128 state, seed 0, fed `prefix` first: the digest equals Python's
   xxhash.xxh3_128(prefix).update(data...).digest(). NULL on allocation failure. */
XXH3_state_t *dpukv_xxh3_new(const unsigned char *prefix, size_t prefix_len)
{
    XXH3_state_t *s;
    if (!xxh3_variant) dpukv_xxh3_set_variant(0);
    s = XXH3_createState();
    if (s == NULL) return NULL;
    if (XXH3_128bits_reset(s) != XXH_OK || XXH3_128bits_update(s, prefix, prefix_len) != XXH_OK) {
        XXH3_freeState(s);
        return NULL;
    }
    return s;
}

void dpukv_xxh3_free(XXH3_state_t *s) { XXH3_freeState(s); }

void dpukv_xxh3_update(XXH3_state_t *s, const unsigned char *data, size_t len)
{
    xxh3_update(s, data, len);
}

/* The 16-byte canonical (big-endian) digest, as xxhash's digest(); the state stays usable. */
void dpukv_xxh3_digest(const XXH3_state_t *s, unsigned char out[16])
{
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(s));
    memcpy(out, c.digest, 16);
}

/* Bytes ciphered before they are hashed: a quarter of a 1 MiB L2, so the hash reads what the
   cipher just wrote from L2. Measured on AMD EPYC (Zen 4, VAES), 256 MiB decrypted from cold
   memory and hashed, ms: separate passes 18.4; fused per 4 KiB 21.9, 16 KiB 24.5, 64 KiB 18.9,
   128 KiB 18.5, 256 KiB 16.4, 512 KiB 16.4, 1 MiB 17.1 (per sector, the hash reads lines the
   cipher's stores have not yet written back). */
#ifndef DPUKV_XXH3_GROUP_BYTES
#define DPUKV_XXH3_GROUP_BYTES 262144
#endif
/* dpukv_xts_run, and every sector's plaintext fed to `state` in order: decrypting, the output
   right after it is written; encrypting, the input right before it is read. Sectors go in
   groups of DPUKV_XXH3_GROUP_BYTES (at least one sector). Same return codes as dpukv_xts_run. */
int dpukv_xts_run_xxh3(dpukv_xts *h, const unsigned char *src, unsigned char *dst,
                       size_t sector_bytes, size_t sector_count, uint64_t first_lba,
                       XXH3_state_t *state)
{
    uintptr_t s = (uintptr_t)src, d = (uintptr_t)dst, n = sector_bytes * sector_count;
    size_t group = sector_bytes >= DPUKV_XXH3_GROUP_BYTES ? 1
                 : DPUKV_XXH3_GROUP_BYTES / sector_bytes;
    if (s != d && s < d + n && d < s + n) return 1;
    for (size_t i = 0; i < sector_count; i += group) {
        size_t off = i * sector_bytes, k = sector_count - i < group ? sector_count - i : group;
        int rc;
        if (h->encrypt) xxh3_update(state, src + off, k * sector_bytes);
#ifdef DPUKV_HAVE_X86
        if (h->impl == DPUKV_IMPL_VAES)
            rc = vaes_run(h, src + off, dst + off, sector_bytes, k, first_lba + i);
        else
#endif
            rc = evp_run(h, src + off, dst + off, sector_bytes, k, first_lba + i);
        if (rc != 0) return rc < 0 ? rc - (int)i : rc;
        if (!h->encrypt) xxh3_update(state, dst + off, k * sector_bytes);
    }
    return 0;
}

/* ---------------------------------------------------------------- mapped sources ----------- */

#define DPUKV_RC_FAULT 2 /* the source raised SIGBUS: a page of the mapping could not be read */

static __thread sigjmp_buf *guard_jump; /* set while this thread reads a guarded mapping */
static struct sigaction guard_previous;
static pthread_once_t guard_once = PTHREAD_ONCE_INIT;
static int guard_installed; /* 1 when the handler is in place */

static void guard_handler(int sig, siginfo_t *info, void *uctx)
{
    sigjmp_buf *jump = guard_jump;
    if (jump != NULL) {
        guard_jump = NULL;
        siglongjmp(*jump, 1);
    }
    /* Not ours: hand it to whoever had SIGBUS before (Python's faulthandler, say), or let the
       default action end the process as it would have without this handler. */
    if (guard_previous.sa_flags & SA_SIGINFO) {
        guard_previous.sa_sigaction(sig, info, uctx);
    } else if (guard_previous.sa_handler != SIG_DFL && guard_previous.sa_handler != SIG_IGN) {
        guard_previous.sa_handler(sig);
    } else {
        signal(sig, SIG_DFL); /* the faulting access runs again on return and ends the process */
    }
}

static void guard_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = guard_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    guard_installed = sigaction(SIGBUS, &sa, &guard_previous) == 0;
}

/* dpukv_xts_run (state NULL) or dpukv_xts_run_xxh3 over a memory-mapped `src`. Returns their
   codes, or DPUKV_RC_FAULT when reading `src` raised SIGBUS (dst then holds part of the
   output). Returns DPUKV_RC_FAULT at once where the handler could not be installed. */
int dpukv_xts_run_mapped(dpukv_xts *h, const unsigned char *src, unsigned char *dst,
                         size_t sector_bytes, size_t sector_count, uint64_t first_lba,
                         XXH3_state_t *state)
{
    sigjmp_buf jump;
    int rc;
    pthread_once(&guard_once, guard_install);
    if (!guard_installed) return DPUKV_RC_FAULT;
    if (sigsetjmp(jump, 1) != 0) return DPUKV_RC_FAULT; /* the handler cleared guard_jump */
    guard_jump = &jump;
    rc = state == NULL ? dpukv_xts_run(h, src, dst, sector_bytes, sector_count, first_lba)
                       : dpukv_xts_run_xxh3(h, src, dst, sector_bytes, sector_count,
                                            first_lba, state);
    guard_jump = NULL;
    return rc;
}
