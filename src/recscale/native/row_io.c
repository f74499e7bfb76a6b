/*
 * Batched row I/O for the ssd tier: many rows of a file read or written with up to `depth`
 * requests in flight, never one page fault at a time.
 *
 *   pos  [n] int64     file rows, in the order of buf's rows (ascending gives the most
 *                      coalescing: a run of adjacent rows is one request)
 *   buf  [n, row_bytes] the rows read (or to write), row i at pos[i] * row_bytes
 *
 * A run of list entries with consecutive file rows is one pread/pwrite of up to
 * RUN_BYTES. The caller first issues every run with RWF_NOWAIT: what the page cache
 * holds is copied at once, on this thread, with no thread started (a table that fits in
 * memory pays one syscall a run, nothing more). The runs that would wait for the disk
 * are then issued through io_uring where the kernel offers it (row_uring.c: the caller
 * alone submits and reaps, ~4-5 us of kernel CPU a 4 KiB read on a VM), else shared
 * among `depth` threads (the caller is one of them) by an atomic counter, so a slow
 * request holds up only its own thread (~7-9 us a read: a blocked pread is two context
 * switches). `engine`: 0 = io_uring if it can be had, else the threads; 1 = the threads;
 * 2 = io_uring or -ENOSYS; + 4: no RWF_NOWAIT pass, every run a slow one (tests: a file
 * just written is all in the page cache). RECSCALE_IO_URING=0 in the environment turns
 * io_uring off. Where RWF_NOWAIT is not supported (old kernels, some filesystems, most
 * buffered writes) every run is a slow one.
 *
 * Returns the number of requests issued (>= 0), or -errno of the first that failed (the
 * buffer's contents are then undefined; the file's, for a write, partly written).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif

#include "recscale_native.h"

#define RUN_BYTES (256 * 1024) /* a longer run is split: keeps requests balanced */
#define MAX_DEPTH 256

typedef struct {
    int fd;
    int write;
    const int64_t *pos;
    char *buf;
    int64_t row_bytes;
    const int64_t *run_start; /* run r: list entries [run_start[r], run_start[r + 1]) */
    int64_t *run_done;        /* bytes of run r already transferred (by the no-wait pass) */
    const int64_t *slow;      /* the runs left for the threads */
    int64_t nruns;
    atomic_llong next;
    atomic_int err;
} io_job;

/* Run r without waiting for the disk: 1 = done, 0 = left for the threads (part of it
 * may be done), -1 = RWF_NOWAIT unsupported here, > 1 = errno + 1 of a failure. */
static int try_run_nowait(io_job *j, int64_t r) {
    int64_t first = j->run_start[r], len = (j->run_start[r + 1] - first) * j->row_bytes;
    off_t off = (off_t)(j->pos[first] * j->row_bytes);
    char *p = j->buf + first * j->row_bytes;
    int64_t done = 0;
    while (done < len) {
        struct iovec iov = {p + done, (size_t)(len - done)};
        ssize_t got = j->write ? pwritev2(j->fd, &iov, 1, off + done, RWF_NOWAIT)
                               : preadv2(j->fd, &iov, 1, off + done, RWF_NOWAIT);
        if (got < 0) {
            if (errno == EINTR) continue;
            j->run_done[r] = done;
            if (errno == EAGAIN) return 0;
            if (errno == EOPNOTSUPP || errno == ENOSYS || errno == EINVAL) return -1;
            return errno + 1;
        }
        if (got == 0) return (j->write ? EIO : ENODATA) + 1;
        done += got;
    }
    j->run_done[r] = done;
    return 1;
}

static int do_run(io_job *j, int64_t r) {
    int64_t first = j->run_start[r], skip = j->run_done[r];
    int64_t len = (j->run_start[r + 1] - first) * j->row_bytes - skip;
    off_t off = (off_t)(j->pos[first] * j->row_bytes + skip);
    char *p = j->buf + first * j->row_bytes + skip;
    while (len > 0) { /* a short read or write continues where it stopped */
        ssize_t got = j->write ? pwrite(j->fd, p, (size_t)len, off) : pread(j->fd, p, (size_t)len, off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (got == 0) return j->write ? EIO : ENODATA; /* past the end of the file */
        p += got, off += got, len -= got;
    }
    return 0;
}

static void *worker(void *arg) {
    io_job *j = arg;
    for (;;) {
        int64_t k = atomic_fetch_add(&j->next, 1);
        if (k >= j->nruns || atomic_load(&j->err)) break;
        int e = do_run(j, j->slow[k]);
        if (e) {
            int zero = 0;
            atomic_compare_exchange_strong(&j->err, &zero, e);
        }
    }
    return NULL;
}

/* the slow runs through io_uring: 0, an errno, or -1 (io_uring unavailable) */
static int slow_runs_uring(io_job *j, int64_t depth) {
    const int64_t n = j->nruns;
    int64_t *off = malloc((size_t)(2 * n) * sizeof(int64_t));
    char **ptr = malloc((size_t)n * sizeof(char *));
    if (!off || !ptr) {
        free(off), free(ptr);
        return ENOMEM;
    }
    int64_t *len = off + n;
    for (int64_t k = 0; k < n; k++) {
        const int64_t r = j->slow[k], first = j->run_start[r], skip = j->run_done[r];
        off[k] = j->pos[first] * j->row_bytes + skip;
        ptr[k] = j->buf + first * j->row_bytes + skip;
        len[k] = (j->run_start[r + 1] - first) * j->row_bytes - skip;
    }
    const int e = rs_uring_rw(j->fd, j->write, n, off, ptr, len, depth);
    free(off), free(ptr);
    return e;
}

int64_t recscale_row_io(int fd, int write, const int64_t *pos, int64_t n, int64_t row_bytes,
                        void *buf, int64_t depth, int64_t engine) {
    if (n <= 0) return 0;
    int64_t max_rows = RUN_BYTES / row_bytes > 0 ? RUN_BYTES / row_bytes : 1;
    int64_t *run_start = malloc((size_t)(3 * n + 1) * sizeof(int64_t));
    if (!run_start) return -ENOMEM;
    int64_t nruns = 0;
    for (int64_t i = 0; i < n; i++) {
        int joins = i > 0 && pos[i] == pos[i - 1] + 1 && i - run_start[nruns - 1] < max_rows;
        if (!joins) run_start[nruns++] = i;
    }
    run_start[nruns] = n;
    int64_t *run_done = run_start + n + 1, *slow = run_done + n, nslow = 0;
    io_job j = {fd, write, pos, buf, row_bytes, run_start, run_done, slow, 0, 0, 0};
    int nowait = !(engine & 4);
    engine &= 3;
    for (int64_t r = 0; r < nruns; r++) {
        run_done[r] = 0;
        int got = nowait ? try_run_nowait(&j, r) : -1;
        if (got == 1) continue;
        if (got > 1) {
            free(run_start);
            return -(int64_t)(got - 1);
        }
        if (got < 0) nowait = 0; /* unsupported: the rest straight to the threads */
        slow[nslow++] = r;
    }
    j.nruns = nslow;
    if (nslow > 0 && engine != 1) {
        const int e = slow_runs_uring(&j, depth);
        if (e >= 0) {
            free(run_start);
            return e ? -(int64_t)e : nruns;
        }
        if (engine == 2) {
            free(run_start);
            return -ENOSYS;
        }
    }
    int64_t threads = depth < nslow ? depth : nslow;
    if (threads > MAX_DEPTH) threads = MAX_DEPTH;
    pthread_t tid[MAX_DEPTH];
    int64_t started = 0;
    for (int64_t t = 1; t < threads; t++) { /* the caller is thread 0 */
        if (pthread_create(&tid[started], NULL, worker, &j) != 0) break; /* fewer is fine */
        started++;
    }
    worker(&j);
    for (int64_t t = 0; t < started; t++) pthread_join(tid[t], NULL);
    free(run_start);
    int e = atomic_load(&j.err);
    return e ? -(int64_t)e : nruns;
}


/*
 * Rows copied between a file's memory map and a buffer (access=map):
 *
 *   write = 0:  buf[i] = base[pos[i]]        write = 1:  base[pos[i]] = buf[i]
 *
 * Rows sit at random in a file far larger than the caches, so each row is a TLB miss and
 * one or two cache misses: numpy's fancy index takes them one at a time (~370 ns a row
 * beside a training step). Here the row `ROW_AHEAD` entries on is prefetched (for
 * writing, when writing) while this one is copied, so the misses overlap. A page the
 * process has not mapped yet, or one the kernel has cleaned since, still faults on the
 * copy itself: a prefetch never faults.
 */
#define ROW_AHEAD 16

/* every cache line of the row [p, p + row_bytes): rows of 72 bytes start anywhere in a
 * line, so the last byte's line is taken too */
static inline void prefetch_row(const char *p, int64_t row_bytes, int write) {
    const char *last = p + row_bytes - 1;
    for (; p < last; p += 64) {
        if (write)
            __builtin_prefetch(p, 1, 0);
        else
            __builtin_prefetch(p, 0, 0);
    }
    if (write)
        __builtin_prefetch(last, 1, 0);
    else
        __builtin_prefetch(last, 0, 0);
}

void recscale_row_copy(void *base, int write, const int64_t *pos, int64_t n, int64_t row_bytes,
                       void *buf) {
    char *map = base, *b = buf;
    for (int64_t i = 0; i < n; i++) {
        if (i + ROW_AHEAD < n) prefetch_row(map + pos[i + ROW_AHEAD] * row_bytes, row_bytes, write);
        char *row = map + pos[i] * row_bytes;
        if (write)
            memcpy(row, b + i * row_bytes, (size_t)row_bytes);
        else
            memcpy(b + i * row_bytes, row, (size_t)row_bytes);
    }
}

/* Rows between a table in memory (a loaded or mapped tier file: `table_width` floats a
 * row, `table_rows` rows) and the cache's slots, with no buffer between. Entry i is
 * logical row `rows[i]`, at file row `position[rows[i]]` (position NULL: the file row is
 * rows[i]); part `p` of a row is columns [part_col[p], part_col[p] + part_width[p]) of
 * the table row and row `slots[i]` of the C-contiguous float array at address
 * `part_base[p]` (`part_width[p]` floats a row: the cached weights, then each optimizer
 * state). `to_table`: cache -> table (a write-back), else table -> cache (an install).
 * As in recscale_row_copy, the rows `ROW_AHEAD` entries on are prefetched on both sides
 * while this one is copied, and their positions twice as far on. Returns 0, or -1 - i
 * where entry i's file row is outside the table (entries before it are moved). Rows and
 * slots are the caller's to check. */
static inline int64_t file_row(const int32_t *position, const int64_t *rows, int64_t i) {
    return position ? (int64_t)position[rows[i]] : rows[i];
}

int64_t recscale_row_move(float *table, int64_t table_width, int64_t table_rows,
                          const int32_t *position, const int64_t *rows, const int64_t *slots,
                          int64_t n, int to_table, int64_t parts, const int64_t *part_base,
                          const int64_t *part_width, const int64_t *part_col) {
    if (position)
        for (int64_t i = 0; i < n && i < 2 * ROW_AHEAD; i++)
            __builtin_prefetch(&position[rows[i]], 0, 0);
    for (int64_t i = 0; i < n; i++) {
        if (position && i + 2 * ROW_AHEAD < n)
            __builtin_prefetch(&position[rows[i + 2 * ROW_AHEAD]], 0, 0);
        if (i + ROW_AHEAD < n) {
            int64_t j = i + ROW_AHEAD, fj = file_row(position, rows, j);
            if ((uint64_t)fj < (uint64_t)table_rows)
                prefetch_row((const char *)(table + fj * table_width), table_width * 4, to_table);
            for (int64_t p = 0; p < parts; p++) {
                const float *cell = (const float *)(intptr_t)part_base[p] + slots[j] * part_width[p];
                prefetch_row((const char *)cell, part_width[p] * 4, !to_table);
            }
        }
        const int64_t fi = file_row(position, rows, i);
        if ((uint64_t)fi >= (uint64_t)table_rows) return -1 - i;
        float *row = table + fi * table_width;
        for (int64_t p = 0; p < parts; p++) {
            float *cell = (float *)(intptr_t)part_base[p] + slots[i] * part_width[p];
            if (to_table)
                memcpy(row + part_col[p], cell, (size_t)part_width[p] * sizeof(float));
            else
                memcpy(cell, row + part_col[p], (size_t)part_width[p] * sizeof(float));
        }
    }
    return 0;
}
