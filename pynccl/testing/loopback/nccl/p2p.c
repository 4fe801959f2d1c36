/*
 * Point-to-point over the shared-memory world (world.c).
 *
 * P2P: one ring per ordered pair, a 32-byte message header (size, type) then the
 * payload padded to 32 bytes. Ops of one group progress together, so pairs of sends
 * that would deadlock one after the other complete.
 */
#include "internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ---- point to point ----------------------------------------------------------------- */

struct lb_msg {
    uint64_t magic;
    uint64_t nbytes;
    uint64_t count;
    int32_t dtype;
    int32_t src;
};

struct p2p_state {
    size_t total; /* header + payload padded to LB_MSG_HDR */
    size_t done;  /* bytes of total moved */
    int finished;
};

static inline struct lbw_ring *ring_of(struct lb_comm *c, int src, int dst) {
    return &c->rings[(size_t)src * (size_t)c->nranks + (size_t)dst];
}

static inline char *ringdata_of(struct lb_comm *c, int src, int dst) {
    return c->ringdata + ((size_t)src * (size_t)c->nranks + (size_t)dst) * c->ring_bytes;
}

static void ring_put(char *data, size_t cap, uint64_t pos, const char *src, size_t len) {
    size_t at = (size_t)(pos % cap);
    size_t first = len < cap - at ? len : cap - at;
    memcpy(data + at, src, first);
    if (len > first) memcpy(data, src + first, len - first);
}

static void ring_get(const char *data, size_t cap, uint64_t pos, char *dst, size_t len) {
    size_t at = (size_t)(pos % cap);
    size_t first = len < cap - at ? len : cap - at;
    memcpy(dst, data + at, first);
    if (len > first) memcpy(dst + first, data, len - first);
}

/* A sender's first send to `peer` reserves its ring's pages (create_world leaves them to
 * this, as NCCL connects p2p peers at runtime). NCCL connects in ncclGroupEnd (or in
 * ncclSend outside a group), before anything is launched: no room is that call's
 * ncclSystemError, the communicator and its peers untouched, not an asynchronous error of
 * the stream worker that breaks the world (nor a SIGBUS on the copy). Called by the
 * issuing thread (launch.c), which owns c->p2p_conn: the stream worker never reads it. */
ncclResult_t lb_p2p_connect(struct lb_comm *c, int peer) {
    if (c->p2p_conn[peer]) return ncclSuccess;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)ringdata_of(c, c->rank, peer);
    uintptr_t hi = lo + c->ring_bytes;
    lo &= ~(page - 1);
    hi = (hi + page - 1) & ~(page - 1);
    int e = lbw_populate((char *)lo, (size_t)(hi - lo));
    if (e != 0)
        return lb_err(ncclSystemError,
                      "ncclSend : rank %d cannot reserve %zu bytes of shared memory for its ring "
                      "to rank %d: %s (is the memory limit reached?)",
                      c->rank, (size_t)c->ring_bytes, peer, strerror(e));
    c->p2p_conn[peer] = 1;
    return ncclSuccess;
}

/* Move what can be moved now for one op; returns 1 on progress, or an error code
 * through *err. */
static int p2p_step(struct lb_comm *c, const struct lb_op *op, struct p2p_state *st,
                    ncclResult_t *err) {
    const size_t cap = c->ring_bytes;
    const size_t E = lb_type_size(op->dtype);
    const size_t nbytes = op->count * E;
    int moved = 0;
    if (op->kind == LB_K_SEND) {
        struct lbw_ring *rg = ring_of(c, c->rank, op->root);
        char *data = ringdata_of(c, c->rank, op->root);
        uint64_t head = __atomic_load_n(&rg->head, __ATOMIC_RELAXED);
        uint64_t tail = __atomic_load_n(&rg->tail, __ATOMIC_ACQUIRE);
        size_t space = cap - (size_t)(head - tail);
        if (st->done == 0) {
            if (space < LB_MSG_HDR) return 0;
            struct lb_msg m = {LB_MSG_MAGIC, nbytes, op->count, op->dtype, c->rank};
            char hdr[LB_MSG_HDR];
            memset(hdr, 0, sizeof hdr);
            memcpy(hdr, &m, sizeof m);
            ring_put(data, cap, head, hdr, LB_MSG_HDR);
            head += LB_MSG_HDR;
            space -= LB_MSG_HDR;
            st->done = LB_MSG_HDR;
            moved = 1;
        }
        size_t want = st->total - st->done;
        size_t len = want < space ? want : space;
        if (len) {
            size_t p = st->done - LB_MSG_HDR; /* payload offset */
            size_t real = p < nbytes ? (nbytes - p < len ? nbytes - p : len) : 0;
            if (real) ring_put(data, cap, head, (const char *)op->sbuf + p, real);
            head += len;
            st->done += len;
            moved = 1;
        }
        if (moved) __atomic_store_n(&rg->head, head, __ATOMIC_RELEASE);
    } else {
        struct lbw_ring *rg = ring_of(c, op->root, c->rank);
        const char *data = ringdata_of(c, op->root, c->rank);
        uint64_t tail = __atomic_load_n(&rg->tail, __ATOMIC_RELAXED);
        uint64_t head = __atomic_load_n(&rg->head, __ATOMIC_ACQUIRE);
        size_t avail = (size_t)(head - tail);
        if (st->done == 0) {
            if (avail < LB_MSG_HDR) return 0;
            struct lb_msg m;
            char hdr[LB_MSG_HDR];
            ring_get(data, cap, tail, hdr, LB_MSG_HDR);
            memcpy(&m, hdr, sizeof m);
            if (m.magic != LB_MSG_MAGIC) {
                lbw_break(c, ncclInternalError, 1, "loopback p2p ring from rank %d corrupted", op->root);
                *err = ncclInternalError;
                return 0;
            }
            if (m.nbytes != nbytes) {
                lbw_break(c, ncclInvalidUsage, 1,
                          "ncclSend/ncclRecv mismatch: rank %d sent %llu bytes (count=%llu, %s) to "
                          "rank %d, which posted a receive of %zu bytes (count=%zu, %s)",
                          m.src, (unsigned long long)m.nbytes, (unsigned long long)m.count,
                          lb_type_name(m.dtype), c->rank, nbytes, op->count,
                          lb_type_name(op->dtype));
                *err = ncclInvalidUsage;
                return 0;
            }
            tail += LB_MSG_HDR;
            avail -= LB_MSG_HDR;
            st->done = LB_MSG_HDR;
            moved = 1;
        }
        size_t want = st->total - st->done;
        size_t len = want < avail ? want : avail;
        if (len) {
            size_t p = st->done - LB_MSG_HDR;
            size_t real = p < nbytes ? (nbytes - p < len ? nbytes - p : len) : 0;
            if (real) ring_get(data, cap, tail, (char *)op->rbuf + p, real);
            tail += len;
            st->done += len;
            moved = 1;
        }
        if (moved) __atomic_store_n(&rg->tail, tail, __ATOMIC_RELEASE);
    }
    if (st->done == st->total) st->finished = 1;
    return moved;
}

ncclResult_t lbx_exec_p2p(struct lb_comm *c, const struct lb_op *ops, int n) {
    struct p2p_state stack_st[16];
    struct p2p_state *st = n <= 16 ? stack_st : calloc((size_t)n, sizeof *st);
    if (!st) return lb_err(ncclSystemError, "loopback: out of memory for %d p2p ops", n);
    for (int i = 0; i < n; i++) {
        size_t nbytes = ops[i].count * lb_type_size(ops[i].dtype);
        st[i].total = LB_MSG_HDR + (nbytes + LB_MSG_HDR - 1) / LB_MSG_HDR * LB_MSG_HDR;
        st[i].done = 0;
        st[i].finished = 0;
    }
    ncclResult_t ret = ncclSuccess;
    int spins = 0, recheck_pending = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        int progressed = 0, pending = 0, blocker = -1;
        for (int i = 0; i < n; i++) {
            if (st[i].finished) continue;
            /* ops to the same peer in the same direction go in order */
            int earlier = 0;
            for (int j = 0; j < i && !earlier; j++)
                earlier = !st[j].finished && ops[j].kind == ops[i].kind && ops[j].root == ops[i].root;
            pending++;
            if (earlier) continue;
            ncclResult_t err = ncclSuccess;
            if (p2p_step(c, &ops[i], &st[i], &err)) progressed = 1;
            if (err != ncclSuccess) {
                ret = err;
                goto out;
            }
            if (st[i].finished) pending--;
            else if (blocker < 0) blocker = ops[i].root;
        }
        if (!pending) break;
        if (progressed) {
            lbw_notify(c);
            spins = 0;
            recheck_pending = 0;
            continue;
        }
        if (recheck_pending) {
            ret = lbw_gone(c, blocker, "ncclSend/ncclRecv");
            goto out;
        }
        int recheck;
        ncclResult_t r = lbw_trouble(c, blocker, &recheck);
        if (recheck) {
            recheck_pending = 1; /* one more pass: the peer may have finished first */
            continue;
        }
        if (r != ncclSuccess) {
            ret = r;
            goto out;
        }
        lbw_backoff(c, e, &spins);
    }
out:
    if (st != stack_st) free(st);
    return ret;
}

/* PYNCCL_LOOPBACK_HANG: block until the comm is aborted (or the world breaks). */
ncclResult_t lbx_hang(struct lb_comm *c) {
    int spins = 0;
    lb_set_error("rank %d: operation #%llu hangs on purpose (PYNCCL_LOOPBACK_HANG)", c->rank,
                 (unsigned long long)c->nexec);
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        int recheck;
        ncclResult_t r = lbw_trouble(c, -1, &recheck);
        if (r != ncclSuccess) return r;
        if (spins < g_spin_pause + g_spin_yield) spins = g_spin_pause + g_spin_yield;
        lbw_backoff(c, e, &spins);
    }
}
