/* Expert block reads on native threads (cache/store.py NativeReadPool).

   The Python reader pool it replaces ran each read's bookkeeping (queue, future, wake-up) in
   Python, so every read took the GIL a few times on a reader thread. On a 2-core machine each
   grab landed while the compute thread's C kernels held both cores, so the compute thread, back
   from a kernel, waited for a reader thread to be scheduled and let the GIL go. Here a read is
   queued, performed and completed without Python: the engine thread submits a job (a pread of
   `len` bytes at `off` into `dst`) and later waits for it, and the reader threads never touch
   the interpreter. Inside 8 GiB at 4K of context on the AMD EPYC Zen 4 (2026-12-04): a decode
   step 261.6 -> 208.7 ms in benchmarks/step_profile.py, 1.105x in a commit A/B (the same bytes).

   Two queues, as the Python pool had: demand reads (a miss the compute waits for) are taken
   before any queued prefetch. A job is a heap object the caller owns from rp_submit until
   rp_free (after rp_wait, or after rp_destroy has drained the queues).

   A job of segments (rp_submit_segs) reads an in-place pack's block: each tensor's bytes lie at
   an unaligned offset of a source GGUF, so each is read as its page-aligned superset into the
   slot and, where the pack's template could not place the tensor at the same offset in a page as
   every expert's bytes lie in the file (the experts' sizes not a multiple of a page), moved down
   over its `head` bytes (memmove). The segments of one job are read by as
   many threads as are free (a worker that claims one puts the job back at the head of its queue
   while segments are left): three ~1 MB reads one after the other cost each its own request
   latency, which one 3 MB read of a copied pack pays once (inside 8 GiB on the 48-layer file an
   in-place pack decoded at 0.86x a copied one with its segments read in turn). The pack's block
   template leaves a page after each tensor, so no segment's superset reaches the next one's. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define RP_MAX_SEGS 8

typedef struct {
    int fd;
    long off, len;      /* the pread: len bytes at off (page-aligned for O_DIRECT) */
    long dst_off;       /* where in dst it lands */
    long head, n;       /* the wanted bytes are [head, head + n) of what was read */
    long move;          /* nonzero: move them down to dst_off (else they stay where they landed) */
} rp_seg;

typedef struct rp_job {
    struct rp_job *next;
    int nseg, claimed, left, demand;   /* segments; claimed by workers; not yet read; which queue */
    rp_seg seg[RP_MAX_SEGS];
    unsigned char *dst;
    long got;          /* bytes read (a short count at end of file), valid once done */
    int err;           /* errno of a failed read, 0 if none */
    int done;          /* set (atomically, under the pool's lock) once the read has ended */
} rp_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, finished;
    rp_job *demand_head, *demand_tail, *pf_head, *pf_tail;
    int closed, n_threads;
    pthread_t threads[64];
} rp_pool;

/* Bytes read of one segment (its wanted bytes moved to dst_off), or -errno. */
static long seg_read(const rp_seg *s, unsigned char *dst) {
    long done = 0;
    unsigned char *to = dst + s->dst_off;
    while (done < s->len) {
        ssize_t r = pread(s->fd, to + done, (size_t)(s->len - done), (off_t)(s->off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(long)errno;
        }
        if (r == 0) break;      /* end of file */
        done += r;
    }
    long got = done - s->head;
    if (got < 0) got = 0;
    if (got > s->n) got = s->n;
    if (s->move && s->head && got > 0) memmove(to, to + s->head, (size_t)got);
    return got;
}

static rp_job *pop(rp_job **head, rp_job **tail) {
    rp_job *j = *head;
    if (j) {
        *head = j->next;
        if (!*head) *tail = NULL;
        j->next = NULL;
    }
    return j;
}

static void push_front(rp_job **head, rp_job **tail, rp_job *j) {
    j->next = *head;
    *head = j;
    if (!*tail) *tail = j;
}

static void *worker(void *arg) {
    rp_pool *p = (rp_pool *)arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        rp_job *j = pop(&p->demand_head, &p->demand_tail);
        if (!j) j = pop(&p->pf_head, &p->pf_tail);
        if (!j) {
            if (p->closed) break;
            pthread_cond_wait(&p->work, &p->mu);
            continue;
        }
        int i = j->claimed++;
        if (j->claimed < j->nseg) {     /* segments left: the next free worker takes one */
            if (j->demand) push_front(&p->demand_head, &p->demand_tail, j);
            else push_front(&p->pf_head, &p->pf_tail, j);
            pthread_cond_signal(&p->work);
        }
        pthread_mutex_unlock(&p->mu);
        long got = seg_read(&j->seg[i], j->dst);
        pthread_mutex_lock(&p->mu);
        if (got < 0) {
            if (!j->err) j->err = (int)-got;
        } else {
            j->got += got;               /* a short segment leaves the sum short: the caller sees it */
        }
        if (--j->left == 0) {
            __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
            pthread_cond_broadcast(&p->finished);
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

void *rp_create(int threads) {
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    rp_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->finished, NULL);
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p) != 0) break;
        p->n_threads++;
    }
    if (p->n_threads == 0) {
        free(p);
        return NULL;
    }
    return p;
}

static void *enqueue(rp_pool *p, rp_job *j, int demand);

/* Queue a read; NULL when out of memory or the pool is closed. */
void *rp_submit(void *pool, int fd, long off, long len, void *dst, int demand) {
    rp_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->nseg = j->left = 1;
    j->seg[0] = (rp_seg){fd, off, len, 0, 0, len, 0};
    j->dst = (unsigned char *)dst;
    return enqueue((rp_pool *)pool, j, demand);
}

/* Queue a read of `nseg` segments, seven longs each in `segs`: fd, off, len, dst_off, head, n, move.
   The job's result is the sum of the wanted bytes read (short where a file ended early). */
void *rp_submit_segs(void *pool, int nseg, const long *segs, void *dst, int demand) {
    if (nseg < 1 || nseg > RP_MAX_SEGS) return NULL;
    rp_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->nseg = j->left = nseg;
    for (int i = 0; i < nseg; i++) {
        const long *s = segs + 7 * i;
        j->seg[i] = (rp_seg){(int)s[0], s[1], s[2], s[3], s[4], s[5], s[6]};
    }
    j->dst = (unsigned char *)dst;
    return enqueue((rp_pool *)pool, j, demand);
}

static void *enqueue(rp_pool *p, rp_job *j, int demand) {
    j->demand = demand;
    pthread_mutex_lock(&p->mu);
    if (p->closed) {
        pthread_mutex_unlock(&p->mu);
        free(j);
        return NULL;
    }
    rp_job **head = demand ? &p->demand_head : &p->pf_head, **tail = demand ? &p->demand_tail : &p->pf_tail;
    if (*tail) (*tail)->next = j; else *head = j;
    *tail = j;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
    return j;
}

/* Whether the job's read has ended. Needs no pool: valid after rp_destroy (every job is done). */
int rp_done(void *job) { return __atomic_load_n(&((rp_job *)job)->done, __ATOMIC_ACQUIRE); }

/* Block until the job is done; returns the bytes read, or -errno of a failed read. A job that is
   done already (every job, after rp_destroy) does not touch the pool. */
long rp_wait(void *pool, void *job) {
    rp_pool *p = (rp_pool *)pool;
    rp_job *j = (rp_job *)job;
    if (!__atomic_load_n(&j->done, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&p->mu);
        while (!__atomic_load_n(&j->done, __ATOMIC_ACQUIRE)) pthread_cond_wait(&p->finished, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    return j->err ? -(long)j->err : j->got;
}

void rp_free(void *job) { free(job); }

/* Read every queued job, stop the threads and free the pool (the jobs stay the caller's). */
void rp_destroy(void *pool) {
    rp_pool *p = (rp_pool *)pool;
    pthread_mutex_lock(&p->mu);
    p->closed = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->finished);
    pthread_mutex_destroy(&p->mu);
    free(p);
}
