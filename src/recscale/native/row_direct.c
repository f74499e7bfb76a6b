/*
 * Rows read or written through a file opened with O_DIRECT (access=direct): the same
 * contract as recscale_row_io (row_io.c) - buf [n, row_bytes], row i at file row pos[i] -
 * but the disk is asked for whole aligned blocks and rows move through a bounce buffer:
 *
 *   file    |   block b   |  block b+1  |  block b+2  |   ...      (`block` bytes each)
 *   rows      [r0][r1]...[r59][r60 straddles b|b+1]...
 *   bounce  [ block b | block b+1 | block b+5 | ... ]   the distinct blocks the rows touch,
 *                                                     ascending; adjacent blocks are one
 *                                                     request (row_io.c's runs)
 *
 * read:  the blocks are read (no page-cache pass: there is none), then each row copied
 *        out of its block(s).
 * write: the blocks a batch's rows do not cover whole are read first, the rows copied in,
 *        then the blocks written - a read-modify-write of each block in user space. A
 *        batch's writes must not race another write of the same blocks (the tier writes
 *        under its lock); a concurrent read of another row of a block sees that row's
 *        bytes unchanged either way.
 *
 * Why: a buffered read of a page the cache lacks allocates a page, inserts it into the
 * page cache and copies it out, and for a file beyond memory the kernel must reclaim
 * another page for it; a buffered write of a 68-byte row reads its page synchronously
 * first. A direct read is the device's DMA into the bounce buffer: on host E (2-vCPU VM,
 * virtio disk, io_uring at depth 32-64) 2.3-2.9 us of CPU a 4 KiB read against 4.3-4.9
 * buffered (docs/performance.md).
 *
 * pos must be ascending (the tier sorts its batches); the file must extend to a whole
 * number of blocks (RowFile pads it). Returns the requests issued (>= 0), -EINVAL for an
 * unsorted pos or a bad block size, -ENOMEM, or recscale_row_io's -errno.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "recscale_native.h"

/* A thread's bounce buffer, kept between calls and grown as needed (freed when the
 * thread exits): a fresh multi-megabyte buffer a batch is a new mapping whose pages the
 * device's DMA first faults in and whose unmapping shoots down TLBs on every core - the
 * direct reads ran at ~59k/s beside training that way against ~100k/s buffered. */
typedef struct {
    char *p;
    size_t cap;
} bounce_t;

static pthread_key_t bounce_key;
static pthread_once_t bounce_once = PTHREAD_ONCE_INIT;

static void free_bounce(void *arg) {
    bounce_t *b = arg;
    free(b->p);
    free(b);
}

static void make_bounce_key(void) { pthread_key_create(&bounce_key, free_bounce); }

#define KEEP_MAX ((size_t)32 << 20) /* larger (a table's initial segments): not kept */

static char *thread_bounce(size_t bytes, size_t align) {
    if (bytes > KEEP_MAX) {
        char *p = NULL;
        return posix_memalign((void **)&p, align, bytes) ? NULL : p;
    }
    pthread_once(&bounce_once, make_bounce_key);
    bounce_t *b = pthread_getspecific(bounce_key);
    if (!b) {
        b = calloc(1, sizeof(bounce_t));
        if (!b || pthread_setspecific(bounce_key, b)) {
            free(b);
            return NULL;
        }
    }
    if (b->cap < bytes) {
        size_t cap = b->cap ? b->cap : (size_t)1 << 20;
        while (cap < bytes) cap <<= 1;
        char *p = NULL;
        if (posix_memalign((void **)&p, align, cap)) return NULL;
        free(b->p);
        b->p = p, b->cap = cap;
    }
    return b->p;
}

int64_t recscale_row_io_direct(int fd, int write, const int64_t *pos, int64_t n,
                               int64_t row_bytes, void *buf, int64_t depth, int64_t engine,
                               int64_t block) {
    if (n <= 0) return 0;
    if (block <= 0 || (block & (block - 1)) || row_bytes <= 0) return -EINVAL;
    for (int64_t i = 1; i < n; i++)
        if (pos[i] <= pos[i - 1]) return -EINVAL;
    /* the distinct blocks, ascending (rows ascending: first and last blocks never fall) */
    /* a row spans at most row_bytes / block + 2 blocks */
    int64_t *blocks = malloc((size_t)(n * (row_bytes / block + 2)) * sizeof(int64_t));
    if (!blocks) return -ENOMEM;
    int64_t nb = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t lo = pos[i] * row_bytes / block, hi = (pos[i] * row_bytes + row_bytes - 1) / block;
        for (int64_t b = lo; b <= hi; b++)
            if (nb == 0 || blocks[nb - 1] != b) blocks[nb++] = b;
    }
    /* the blocks, then (a write) room for its partly covered ones: nb more at most */
    const size_t align = (size_t)(block < 4096 ? 4096 : block);
    char *bounce = thread_bounce((size_t)((write ? 2 : 1) * nb * block), align);
    if (!bounce) {
        free(blocks);
        return -ENOMEM;
    }
    int64_t requests = 0, rc = 0;
    const int64_t no_nowait = (engine & 3) | 4;
    if (!write) {
        rc = recscale_row_io(fd, 0, blocks, nb, block, bounce, depth, no_nowait);
    } else {
        /* a block the batch's rows cover whole need not be read: bytes covered a block */
        int64_t *covered = calloc((size_t)nb, sizeof(int64_t));
        int64_t *partial = malloc((size_t)nb * sizeof(int64_t));
        char *pbuf = bounce + nb * block;
        if (!covered || !partial) rc = -ENOMEM;
        for (int64_t i = 0, k = 0; rc == 0 && i < n; i++) {
            int64_t at = pos[i] * row_bytes, end = at + row_bytes;
            while (blocks[k] < at / block) k++;
            for (int64_t kk = k; at < end; kk++) {
                const int64_t stop = (blocks[kk] + 1) * block < end ? (blocks[kk] + 1) * block : end;
                covered[kk] += stop - at;
                at = stop;
            }
        }
        int64_t np = 0;
        for (int64_t k = 0; rc == 0 && k < nb; k++)
            if (covered[k] < block) partial[np++] = k;
        if (rc == 0 && np > 0) {
            /* read the partial blocks contiguously, then spread them to their places */
            int64_t *ppos = malloc((size_t)np * sizeof(int64_t));
            if (!ppos) rc = -ENOMEM;
            for (int64_t q = 0; rc == 0 && q < np; q++) ppos[q] = blocks[partial[q]];
            if (rc == 0) rc = recscale_row_io(fd, 0, ppos, np, block, pbuf, depth, no_nowait);
            if (rc >= 0) {
                requests += rc;
                for (int64_t q = 0; q < np; q++)
                    memcpy(bounce + partial[q] * block, pbuf + q * block, (size_t)block);
                rc = 0;
            }
            free(ppos);
        }
        free(covered), free(partial);
    }
    if (rc >= 0) {
        if (!write) requests += rc;
        /* rows between buf and the bounce buffer: a row's blocks are adjacent there */
        char *b = buf;
        for (int64_t i = 0, k = 0; i < n; i++) {
            const int64_t at = pos[i] * row_bytes;
            while (blocks[k] < at / block) k++;
            char *p = bounce + k * block + (at - blocks[k] * block);
            if (write)
                memcpy(p, b + i * row_bytes, (size_t)row_bytes);
            else
                memcpy(b + i * row_bytes, p, (size_t)row_bytes);
        }
        if (write) {
            rc = recscale_row_io(fd, 1, blocks, nb, block, bounce, depth, no_nowait);
            if (rc >= 0) requests += rc;
        }
    }
    if ((size_t)((write ? 2 : 1) * nb * block) > KEEP_MAX) free(bounce); /* not kept */
    free(blocks);
    return rc < 0 ? rc : requests;
}
