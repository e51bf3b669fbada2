/* Block copies of the host executor, compiled: each buffer's flat range moved
 * from the rows of the source ranks to the rows of the target ranks; the
 * gather that writes a tile of narrow buffers' target rows from its table; the
 * check that runs of source padding hold no set bit; a read of one word of each
 * of many objects; the crc32c check of a
 * span's chunks; and, on Linux, spans of a shard file read (preadv) and checked
 * one after another in one call.
 *
 * A buffer ("block") lies at columns [so, so + ss) of every source row and at
 * columns [to, to + ts) of every target row; its rows concatenated are its flat
 * elements. Block b's flat range [lo, hi) is copied so that flat element lo
 * lands at column to of target row 0: target row r holds flat elements
 * [lo + r * ts, lo + (r + 1) * ts). Every overlap of a source row and a target
 * row is one copy; nothing else is written, so what no block covers keeps the
 * caller's zeros.
 *
 * The caller checks every table against both arrays' shapes, and that both
 * arrays start at an address aligned to the element width with rows a whole
 * number of elements apart, before calling: no bound or alignment is checked
 * here, except that the tile gather sends every index past its tile to the
 * tile's last element. No pointer is formed outside the two arrays. Elements
 * move as unsigned integers of their width, never as values. The functions
 * take no Python object and hold no lock: they run with the interpreter's lock
 * released (ctypes releases it for the call).
 */
/* preadv is declared by glibc's <sys/uio.h> only where this is defined (a strict
 * -std=c99 build hides it otherwise). */
#define _DEFAULT_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* A hint that memory at `p` is read soon, where the compiler has one. */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif

/* Pieces of at most this many elements are copied element by element: the C
 * library's memcpy costs more than the copy for a few elements. */
#define SHORT 8

#define BLOCK_COPY(T, NAME)                                                      \
  static void NAME(const char *src, int64_t src_stride, char *out,             \
                   int64_t out_stride, int64_t n, const int64_t *so,           \
                   const int64_t *ss, const int64_t *to, const int64_t *ts,    \
                   const int64_t *lo, const int64_t *hi) {                     \
    for (int64_t b = 0; b < n; b++) {                                          \
      int64_t at = lo[b];                                                      \
      const int64_t stop = hi[b], s = ss[b], t = ts[b];                        \
      if (at >= stop) continue;                                                \
      /* The source row holding flat element `at`: its first flat element and \
         its end; the same of the target row (row 0 starts at `lo`). */        \
      int64_t k = at / s;                                                      \
      int64_t src_first = k * s, src_end = src_first + s;                      \
      int64_t out_first = at, out_end = at + t;                                \
      /* The block's first column in those rows. */                           \
      const T *sp = (const T *)(src + k * src_stride) + so[b];                 \
      T *op = (T *)out + to[b];                                                \
      for (;;) {                                                               \
        int64_t end = src_end < out_end ? src_end : out_end;                   \
        if (stop < end) end = stop;                                            \
        const T *from = sp + (at - src_first);                                 \
        T *into = op + (at - out_first);                                       \
        const int64_t count = end - at;                                        \
        if (count <= SHORT) {                                                  \
          for (int64_t j = 0; j < count; j++) into[j] = from[j];               \
        } else {                                                               \
          memcpy(into, from, (size_t)count * sizeof(T));                       \
        }                                                                      \
        at = end;                                                              \
        if (at == stop) break;                                                 \
        if (at == src_end) { /* the next source row */                         \
          src_first = src_end;                                                 \
          src_end += s;                                                        \
          sp = (const T *)((const char *)sp + src_stride);                     \
        }                                                                      \
        if (at == out_end) { /* the next target row */                         \
          out_first = out_end;                                                 \
          out_end += t;                                                        \
          op = (T *)((char *)op + out_stride);                                 \
        }                                                                      \
      }                                                                        \
    }                                                                          \
  }

BLOCK_COPY(uint8_t, copy1)
BLOCK_COPY(uint16_t, copy2)
BLOCK_COPY(uint32_t, copy4)
BLOCK_COPY(uint64_t, copy8)

/* Tile gathers: target row r (`out_stride` bytes after row r - 1) takes `width`
 * elements, element c being tile[index[r * width + c]]. An index past the
 * tile's last element reads that last element (the caller places a zero
 * there for padding), so no index, whatever it holds, reads outside the
 * tile. */
#define TILE_GATHER(T, NAME)                                                     \
  static void NAME(const char *tile, int64_t last, const int32_t *index,         \
                   char *out, int64_t out_stride, int64_t rows,                  \
                   int64_t width) {                                              \
    const T *from = (const T *)tile;                                             \
    const uint32_t top = (uint32_t)last;                                         \
    for (int64_t r = 0; r < rows; r++) {                                         \
      T *into = (T *)(out + r * out_stride);                                     \
      const int32_t *at = index + r * width;                                     \
      for (int64_t c = 0; c < width; c++) {                                      \
        const uint32_t i = (uint32_t)at[c];                                      \
        into[c] = from[i < top ? i : top];                                       \
      }                                                                          \
    }                                                                            \
  }

TILE_GATHER(uint8_t, gather1)
TILE_GATHER(uint16_t, gather2)
TILE_GATHER(uint32_t, gather4)
TILE_GATHER(uint64_t, gather8)

/* The interface of this file: native.py loads the library only where this is
 * the number it was written for (an editable install keeps a library built
 * from an older copy of this file until it is installed again). */
int jaxreshard_blockcopy_version(void) { return 7; }

/* Writes to out[i] the 8-byte word at address addresses[i], i in [0, n): the
 * words `jaxreshard_first_changed_word` compares with later, read in one call.
 * The same conditions on the addresses hold. */
void jaxreshard_read_words(int64_t n, const int64_t *addresses, uint64_t *out) {
  const int64_t ahead = 64;
  for (int64_t i = 0; i < n && i < ahead; i++) PREFETCH((const void *)(uintptr_t)addresses[i]);
  for (int64_t i = 0; i < n; i++) {
    if (i + ahead < n) PREFETCH((const void *)(uintptr_t)addresses[i + ahead]);
    out[i] = *(const uint64_t *)(uintptr_t)addresses[i];
  }
}

/* The first i in [0, n) whose 8-byte word at address addresses[i] differs from
 * expected[i], or -1 where none does: a field of each of n live objects the
 * caller holds (the version tags of dicts, which `recordguard` compares between
 * calls), read in one call instead of one interpreter call per object. Every
 * address is 8-byte aligned inside an object the caller keeps alive; none is
 * checked here. The objects lie apart in memory: each is asked for well ahead. */
int64_t jaxreshard_first_changed_word(int64_t n, const int64_t *addresses,
                                      const uint64_t *expected) {
  const int64_t ahead = 64;
  for (int64_t i = 0; i < n && i < ahead; i++) PREFETCH((const void *)(uintptr_t)addresses[i]);
  for (int64_t i = 0; i < n; i++) {
    if (i + ahead < n) PREFETCH((const void *)(uintptr_t)addresses[i + ahead]);
    if (*(const uint64_t *)(uintptr_t)addresses[i] != expected[i]) return i;
  }
  return -1;
}

/* Whether any bit is set in the runs [start[j], start[j] + length[j]) of the
 * `n_flat` elements of `itemsize` bytes at `flat`, j in [0, n): 1 where one is,
 * 0 where none is, -1 (nothing read) for a run that does not lie inside them
 * (a negative start or length included) or an item size below 1. Bits are
 * read as bytes: no element is read as a value. */
int jaxreshard_any_nonzero_runs(const char *flat, int64_t itemsize, int64_t n_flat,
                                int64_t n, const int64_t *start,
                                const int64_t *length) {
  if (itemsize < 1 || n_flat < 0) return -1;
  for (int64_t j = 0; j < n; j++)
    if (start[j] < 0 || length[j] < 0 || start[j] > n_flat - length[j]) return -1;
  /* Runs lie apart in memory: each is asked for well before it is read, so that
   * the reads overlap instead of waiting for memory one run at a time. */
  const int64_t ahead = 16;
  for (int64_t j = 0; j < n && j < ahead; j++) PREFETCH(flat + start[j] * itemsize);
  for (int64_t j = 0; j < n; j++) {
    if (j + ahead < n) PREFETCH(flat + start[j + ahead] * itemsize);
    const unsigned char *p = (const unsigned char *)flat + start[j] * itemsize;
    const int64_t count = length[j] * itemsize;
    unsigned char any = 0;
    for (int64_t i = 0; i < count; i++) any |= p[i];
    if (any) return 1;
  }
  return 0;
}

/* Copies blocks [0, n) (tables of n int64 each) from `src`'s rows (`src_stride`
 * bytes apart) to `out`'s rows (`out_stride` bytes apart), elements of `itemsize`
 * bytes. Returns 0, or -1 (nothing copied) for an item size other than 1, 2, 4
 * or 8 or row strides that are not whole elements. */
int jaxreshard_copy_blocks(const char *src, int64_t src_stride, char *out,
                           int64_t out_stride, int64_t itemsize, int64_t n,
                           const int64_t *so, const int64_t *ss,
                           const int64_t *to, const int64_t *ts,
                           const int64_t *lo, const int64_t *hi) {
  if (itemsize <= 0 || src_stride % itemsize || out_stride % itemsize) return -1;
  switch (itemsize) {
    case 1: copy1(src, src_stride, out, out_stride, n, so, ss, to, ts, lo, hi); return 0;
    case 2: copy2(src, src_stride, out, out_stride, n, so, ss, to, ts, lo, hi); return 0;
    case 4: copy4(src, src_stride, out, out_stride, n, so, ss, to, ts, lo, hi); return 0;
    case 8: copy8(src, src_stride, out, out_stride, n, so, ss, to, ts, lo, hi); return 0;
    default: return -1;
  }
}

/* Writes `rows` target rows of `width` elements of `itemsize` bytes, the first
 * at `out`, the next `out_stride` bytes apart: element c of row r is element
 * index[r * width + c] of `tile` (`n_tile` >= 1 elements), or its last element
 * for an index past it (negative ones included). Returns 0, or -1 (nothing
 * written) for an item size other than 1, 2, 4 or 8, an empty tile, a tile of
 * 2**31 elements or more, or a stride that is not whole elements. */
int jaxreshard_gather_tile(const char *tile, int64_t itemsize, int64_t n_tile,
                           const int32_t *index, char *out, int64_t out_stride,
                           int64_t rows, int64_t width) {
  if (itemsize <= 0 || out_stride % itemsize || n_tile < 1 || n_tile > INT32_MAX)
    return -1;
  const int64_t last = n_tile - 1;
  switch (itemsize) {
    case 1: gather1(tile, last, index, out, out_stride, rows, width); return 0;
    case 2: gather2(tile, last, index, out, out_stride, rows, width); return 0;
    case 4: gather4(tile, last, index, out, out_stride, rows, width); return 0;
    case 8: gather8(tile, last, index, out, out_stride, rows, width); return 0;
    default: return -1;
  }
}

/* A crc32c extended over `count` bytes at `data`, from `crc` (the C library of
 * the google_crc32c package has one: `crc32c_extend`). */
typedef uint32_t (*crc32c_extend_fn)(uint32_t crc, const uint8_t *data, size_t count);

/* Checks chunks [0, n): chunk j's crc32c is `extend` run over its pieces
 * [at[j], at[j + 1]) one after the other from 0 (piece g: `len[g]` bytes from
 * address `addr[g]`), and must equal `expected[j]`. Returns the first chunk
 * whose crc32c differs, or -1 where every one is as expected. The caller checks
 * that every piece lies inside a buffer it holds. */
int64_t jaxreshard_check_chunks(void *extend, int64_t n, const int64_t *at,
                                const uint64_t *addr, const int64_t *len,
                                const uint32_t *expected) {
  const crc32c_extend_fn fn = (crc32c_extend_fn)extend;
  for (int64_t j = 0; j < n; j++) {
    uint32_t crc = 0;
    for (int64_t g = at[j]; g < at[j + 1]; g++)
      crc = fn(crc, (const uint8_t *)(uintptr_t)addr[g], (size_t)len[g]);
    if (crc != expected[j]) return j;
  }
  return -1;
}

#if defined(__linux__)
#include <errno.h>
#include <sys/types.h>
#include <sys/uio.h>

/* Reads spans [0, n) of file `fd` and checks their chunks, span after span,
 * stopping at the first that fails. Span s is the iovecs [seg[s], seg[s + 1])
 * of `iov`, read from file offset pos[s] with preadv, at most `iov_max` iovecs
 * a call (a call interrupted by a signal is made again); its chunks are
 * [first[s], first[s] + count[s]) of the tables jaxreshard_check_chunks takes
 * (`at`, `addr`, `len`, `expected`). Every call's system calls are added to
 * *reads. Returns -1 where every span was read whole and every chunk is as
 * expected; else the failing span, with result[0] what failed (1: the file
 * ended before a span's bytes, 2: a read error, its errno in result[1], 3: a
 * chunk whose crc32c differs, its index in the tables in result[1]). The
 * caller checks every iovec and piece against the buffers it holds. */
int64_t jaxreshard_read_spans(int fd, void *extend, int64_t n, const struct iovec *iov,
                              const int64_t *seg, const int64_t *pos,
                              const int64_t *first, const int64_t *count,
                              const int64_t *at, const uint64_t *addr,
                              const int64_t *len, const uint32_t *expected,
                              int64_t iov_max, int64_t *result, int64_t *reads) {
  for (int64_t s = 0; s < n; s++) {
    int64_t offset = pos[s];
    for (int64_t i = seg[s]; i < seg[s + 1]; i += iov_max) {
      const int64_t j = seg[s + 1] - i < iov_max ? seg[s + 1] : i + iov_max;
      size_t want = 0;
      for (int64_t k = i; k < j; k++) want += iov[k].iov_len;
      ssize_t got;
      do {
        got = preadv(fd, iov + i, (int)(j - i), (off_t)offset);
      } while (got < 0 && errno == EINTR);
      *reads += 1;
      if (got < 0) {
        result[0] = 2;
        result[1] = errno;
        return s;
      }
      if ((size_t)got != want) {
        result[0] = 1;
        return s;
      }
      offset += (int64_t)want;
    }
    const int64_t bad = jaxreshard_check_chunks(extend, count[s], at + first[s], addr, len,
                                                expected + first[s]);
    if (bad >= 0) {
      result[0] = 3;
      result[1] = first[s] + bad;
      return s;
    }
  }
  return -1;
}

int jaxreshard_reads_spans(void) { return 1; }
#else
int jaxreshard_reads_spans(void) { return 0; }
#endif
