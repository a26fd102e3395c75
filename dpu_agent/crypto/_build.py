"""Build the AES-XTS sector loop: `python -m dpu_agent.crypto._build` (the Makefile runs it).

Why C: a new tweak per 4 KiB sector from Python runs at 0.27 GB/s, a C loop over OpenSSL's EVP
at 3.5 GB/s (docs/MEASURED.md). `xts_loop.c` holds that loop, plus an AVX-512 VAES loop
chosen at run time where the CPU has it (the system OpenSSL 3.0 has no VAES XTS code). cffi's
API mode releases the GIL around calls, so several threads encrypt in parallel. The compiled
module `dpu_agent.crypto._xts_cffi` lands in this package directory (gitignored); nothing falls
back to Python when it is missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import cffi

MODULE_NAME = "dpu_agent.crypto._xts_cffi"
PACKAGE_DIR = Path(__file__).resolve().parent

C_FILE = PACKAGE_DIR / "xts_loop.c"
# xxh3's update compiled for wider vectors (each file its own `#pragma GCC target` around the
# shared xxh3_variant.h); xts_loop.c picks one at run time.
EXTRA_C_FILES = (PACKAGE_DIR / "xxh3_avx2.c", PACKAGE_DIR / "xxh3_avx512.c")
HEADER_FILES = (PACKAGE_DIR / "xxh3_variant.h",)

CDEF = """
typedef struct dpukv_xts dpukv_xts;
const char *dpukv_xts_source_digest(void);
int dpukv_xts_best_impl(void);
dpukv_xts *dpukv_xts_new(const unsigned char *key, size_t key_len, int encrypt, int impl);
int dpukv_xts_impl(const dpukv_xts *h);
void dpukv_xts_free(dpukv_xts *h);
int dpukv_xts_run(dpukv_xts *h, const unsigned char *src, unsigned char *dst,
                  size_t sector_bytes, size_t sector_count, uint64_t first_lba);
typedef struct XXH3_state_s XXH3_state_t;
XXH3_state_t *dpukv_xxh3_new(const unsigned char *prefix, size_t prefix_len);
void dpukv_xxh3_free(XXH3_state_t *s);
void dpukv_xxh3_update(XXH3_state_t *s, const unsigned char *data, size_t len);
void dpukv_xxh3_digest(const XXH3_state_t *s, unsigned char out[16]);
int dpukv_xxh3_set_variant(int variant);
int dpukv_xts_run_xxh3(dpukv_xts *h, const unsigned char *src, unsigned char *dst,
                       size_t sector_bytes, size_t sector_count, uint64_t first_lba,
                       XXH3_state_t *state);
int dpukv_xts_run_mapped(dpukv_xts *h, const unsigned char *src, unsigned char *dst,
                         size_t sector_bytes, size_t sector_count, uint64_t first_lba,
                         XXH3_state_t *state);
"""


def source_digest() -> str:
    """Digest of the declarations and C source; the built module carries the one it was built
    from, so an import after a source change says "rebuild" instead of misbehaving."""
    sources = (C_FILE, *EXTRA_C_FILES, *HEADER_FILES)
    text = "\0".join([CDEF, *(path.read_text() for path in sources)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def make_ffibuilder() -> cffi.FFI:
    macros = [("DPUKV_SOURCE_DIGEST", f'"{source_digest()}"')]
    if os.environ.get("DPUKV_XXH3_GROUP_BYTES"):  # experiments only
        macros.append(("DPUKV_XXH3_GROUP_BYTES", os.environ["DPUKV_XXH3_GROUP_BYTES"]))
    if os.environ.get("DPUKV_XTS_NO_VAES"):
        macros.append(("DPUKV_NO_VAES", "1"))
    ffibuilder = cffi.FFI()
    ffibuilder.cdef(CDEF)
    ffibuilder.set_source(
        MODULE_NAME,
        C_FILE.read_text(),
        sources=[str(path) for path in EXTRA_C_FILES],
        libraries=["crypto"],
        extra_compile_args=["-O2", "-Wno-deprecated-declarations"],
        define_macros=macros,
    )
    return ffibuilder


def build() -> Path:
    """Compile in a temporary directory, then move the .so into the package atomically."""
    ffibuilder = make_ffibuilder()
    with tempfile.TemporaryDirectory(prefix="dpukv-xts-build-") as tmp:
        built = Path(ffibuilder.compile(tmpdir=tmp, verbose=False))
        target = PACKAGE_DIR / built.name
        staging = PACKAGE_DIR / f".{built.name}.tmp{os.getpid()}"
        shutil.copyfile(built, staging)
        os.replace(staging, target)  # importers never see a half-written module
    return target


def main() -> int:
    try:
        target = build()
    except Exception as e:  # a compiler or header problem: say what to install
        print(
            f"building {MODULE_NAME} failed: {e}\n"
            "needs a C compiler, OpenSSL headers and xxHash's header xxhash.h "
            "(Debian: apt-get install gcc libssl-dev libxxhash-dev)",
            file=sys.stderr,
        )
        return 1
    print(f"built {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
