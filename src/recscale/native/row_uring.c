/*
 * The ssd tier's slow reads and writes through io_uring (row_io.c's engine where the
 * kernel offers it): requests `i` of `n`, each `len[i]` bytes at file offset `off[i]`
 * into / from `ptr[i]`, up to `depth` in flight, submitted and reaped by the calling
 * thread alone.
 *
 * Why: on a VM a 4 KiB buffered read that waits for the disk costs ~7-9 us of kernel CPU
 * through a blocked pread on one of `depth` threads (two context switches a read), and
 * ~4-5 us through io_uring (measured: 8 GiB file, page cache dropped, 40k random reads
 * at depth 32-64, 2-vCPU Xeon, kernel 6.18). Beyond memory the reads share the step's
 * cores, so their CPU is the step's.
 *
 * One ring a thread (created on first use, closed when the thread exits: ~3 mmaps a
 * thread, none a call). Where io_uring cannot be had (an old kernel, a seccomp profile
 * or a sysctl that forbids it) the first attempt says so and row_io.c keeps its threads.
 * A short transfer is resubmitted for the rest; on an error the requests in flight are
 * reaped before returning (the kernel must be done with the buffers).
 *
 * Returns 0, an errno (> 0) of the first failed request, or -1: io_uring unavailable.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>

#include "recscale_native.h"

#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#endif
#endif

#ifdef IORING_FEAT_RW_CUR_POS /* headers of Linux 5.6 or later: IORING_OP_READ / _WRITE */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define RING_ENTRIES 256 /* >= row_io.c's MAX_DEPTH: every request in flight has an SQE */

typedef struct {
    int fd; /* -1: not set up; -2: unavailable */
    pid_t pid; /* the process that set it up: a forked child makes its own */
    unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *maps[3];
    size_t map_bytes[3];
} ring_t;

static _Thread_local ring_t ring = {-1};
static pthread_key_t ring_key; /* its destructor closes a thread's ring when it exits */
static pthread_once_t ring_key_once = PTHREAD_ONCE_INIT;

static void close_ring(void *arg) {
    ring_t *r = arg;
    for (int k = 0; k < 3; k++) {
        if (r->maps[k] && r->maps[k] != MAP_FAILED) munmap(r->maps[k], r->map_bytes[k]);
        r->maps[k] = NULL; /* never unmapped twice: the range may be another's by then */
    }
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
}

static void make_key(void) { pthread_key_create(&ring_key, close_ring); }

static ring_t *thread_ring(void) {
    /* inherited through fork(): the rings are MAP_SHARED, so the parent's requests and
     * completions would be the child's too - the child sets up its own */
    if (ring.fd >= 0 && ring.pid != getpid()) close_ring(&ring);
    if (ring.fd == -2) return NULL;
    if (ring.fd >= 0) return &ring;
    const char *off = getenv("RECSCALE_IO_URING");
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    /* no setup flags: SINGLE_ISSUER + DEFER_TASKRUN (a waiter woken once for the
     * completions it asked for) read no faster beyond RAM on the 2-vCPU VM (43.6k and
     * 45.6k samples/s against 44.4k and 47.4k, alternating; docs/tiered_storage.md) */
    const int fd = (off && off[0] == '0') ? -1 : (int)syscall(__NR_io_uring_setup, RING_ENTRIES, &p);
    if (fd < 0) {
        ring.fd = -2;
        return NULL;
    }
    ring.pid = getpid();
    size_t sq_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_bytes = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    char *sq = mmap(0, sq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                    IORING_OFF_SQ_RING);
    char *cq = mmap(0, cq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                    IORING_OFF_CQ_RING);
    void *sqes = mmap(0, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    ring.fd = fd;
    ring.maps[0] = sq, ring.maps[1] = cq, ring.maps[2] = sqes;
    ring.map_bytes[0] = sq_bytes, ring.map_bytes[1] = cq_bytes;
    ring.map_bytes[2] = p.sq_entries * sizeof(struct io_uring_sqe);
    if (sq == MAP_FAILED || cq == MAP_FAILED || sqes == MAP_FAILED) {
        close_ring(&ring);
        ring.fd = -2;
        return NULL;
    }
    ring.sq_tail = (unsigned *)(sq + p.sq_off.tail);
    ring.sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    ring.sq_array = (unsigned *)(sq + p.sq_off.array);
    ring.cq_head = (unsigned *)(cq + p.cq_off.head);
    ring.cq_tail = (unsigned *)(cq + p.cq_off.tail);
    ring.cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    ring.sqes = sqes;
    ring.cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    pthread_once(&ring_key_once, make_key);
    pthread_setspecific(ring_key, &ring);
    return &ring;
}

int recscale_io_uring_available(void) { return thread_ring() != NULL; }

int recscale_io_uring_owner(void) { return ring.fd >= 0 ? (int)ring.pid : 0; }

int rs_uring_rw(int fd, int write, int64_t n, const int64_t *off, char *const *ptr,
                const int64_t *len, int64_t depth) {
    if (n <= 0) return 0;
    ring_t *r = thread_ring();
    if (!r) return -1;
    if (depth > RING_ENTRIES) depth = RING_ENTRIES;
    if (depth < 1) depth = 1;
    int64_t *done = calloc((size_t)n, sizeof(int64_t)); /* bytes transferred a request */
    int64_t *again = malloc((size_t)depth * sizeof(int64_t)); /* short ones, to resubmit */
    if (!done || !again) {
        free(done), free(again);
        return ENOMEM;
    }
    int64_t next = 0, nagain = 0, finished = 0, inflight = 0;
    int err = 0;
    while (finished < n && !(err && inflight == 0)) {
        unsigned tail = *r->sq_tail, add = 0;
        while (!err && inflight < depth && (nagain > 0 || next < n)) {
            const int64_t i = nagain > 0 ? again[--nagain] : next++;
            const unsigned idx = tail & *r->sq_mask;
            struct io_uring_sqe *e = &r->sqes[idx];
            memset(e, 0, sizeof *e);
            e->opcode = write ? IORING_OP_WRITE : IORING_OP_READ;
            e->fd = fd;
            e->off = (uint64_t)(off[i] + done[i]);
            e->addr = (uint64_t)(uintptr_t)(ptr[i] + done[i]);
            e->len = (unsigned)(len[i] - done[i]);
            e->user_data = (uint64_t)i;
            r->sq_array[idx] = idx;
            tail++, add++, inflight++;
        }
        __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        /* wait for a quarter of what is in flight, not each one: a wake-up a completion
         * is a context switch of this (low-priority) thread beside a busy step */
        const unsigned want = inflight > 8 ? (unsigned)(inflight / 4) : 1;
        int got = (int)syscall(__NR_io_uring_enter, r->fd, add, want, IORING_ENTER_GETEVENTS, NULL, 0);
        if (got < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
            if (!err) err = errno;
            if (add) break; /* nothing can be known of what was taken: stop here */
        }
        unsigned head = *r->cq_head;
        while (head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            const struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
            const int64_t i = (int64_t)c->user_data;
            head++, inflight--;
            if (c->res == -EINTR || c->res == -EAGAIN) {
                again[nagain++] = i;
            } else if (c->res < 0) {
                if (!err) err = -c->res;
            } else if (c->res == 0) {
                if (!err) err = write ? EIO : ENODATA; /* past the end of the file */
            } else if ((done[i] += c->res) < len[i]) {
                again[nagain++] = i; /* short: the rest next round */
            } else {
                finished++;
            }
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    free(done), free(again);
    return err;
}

#else /* no io_uring in these headers: row_io.c keeps its threads */
int recscale_io_uring_available(void) { return 0; }

int recscale_io_uring_owner(void) { return 0; }

int rs_uring_rw(int fd, int write, int64_t n, const int64_t *off, char *const *ptr,
                const int64_t *len, int64_t depth) {
    (void)fd, (void)write, (void)n, (void)off, (void)ptr, (void)len, (void)depth;
    return -1;
}
#endif
