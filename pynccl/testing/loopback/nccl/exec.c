/*
 * Collectives over the shared-memory world (world.c).
 *
 * Every collective starts with a descriptor barrier: each rank posts (kind, count, type,
 * op, root, buffer addresses, whether it can read every peer's memory); all compare,
 * so mismatched collectives fail with ncclInvalidUsage instead of hanging. Then:
 *
 * Direct mode, when all ranks are threads of one process: each rank pulls what it
 * needs straight from the peers' buffers; a final barrier keeps the sources valid
 * until all have pulled. One copy of the data instead of two, and no chunking.
 *
 * Staged mode otherwise (R ranks, chunk g uses slot buffer g%2; phases 3g+1..3g+3):
 *   AllReduce/Reduce: each rank copies the slices of its chunk that others reduce into
 *     its slot, reduces its own slice in rank order from every slot (its own data read
 *     in place) and publishes the result; everyone copies the other slices back.
 *   Broadcast/Scatter: the root fills its slot; the others copy out.
 *   AllGather/Gather/AlltoAll: everyone fills its slot; readers copy out.
 *   ReduceScatter: everyone fills its slot with the others' segments; each rank reduces
 *     its own segment.
 * Before filling buffer g%2 a rank waits until everyone finished chunk g-2.
 */
#include "internal.h"
#include "lb_env.h"

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

/* ---- collectives -------------------------------------------------------------------- */

static inline char *slot(struct lb_comm *c, uint64_t g, int r) {
    return c->slots + ((size_t)(g & 1) * (size_t)c->nranks + (size_t)r) * c->slot_bytes;
}

static inline void set_step(struct lb_comm *c, uint64_t v) {
    __atomic_store_n(&c->ranks[c->rank].cstep, v, __ATOMIC_RELEASE);
    lbw_notify(c);
}

/* Wait until rank `who` (or everyone, who < 0) reached phase `target`. */
static ncclResult_t wait_steps(struct lb_comm *c, int who, uint64_t target, const char *what) {
    int lo = who < 0 ? 0 : who, hi = who < 0 ? c->nranks : who + 1;
    int s = lo;
    for (; s < hi; s++)
        if (__atomic_load_n(&c->ranks[s].cstep, __ATOMIC_ACQUIRE) < target) break;
    if (s == hi) return ncclSuccess;
    int spins = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        for (; s < hi; s++)
            if (__atomic_load_n(&c->ranks[s].cstep, __ATOMIC_ACQUIRE) < target) break;
        if (s == hi) return ncclSuccess;
        int recheck;
        ncclResult_t r = lbw_trouble(c, s, &recheck);
        if (recheck) {
            if (__atomic_load_n(&c->ranks[s].cstep, __ATOMIC_ACQUIRE) >= target) continue;
            return lbw_gone(c, s, what);
        }
        if (r != ncclSuccess) return r;
        lbw_backoff(c, e, &spins);
    }
}

static void describe(char *out, size_t n, const struct lbw_desc *d) {
    int k = snprintf(out, n, "%s(count=%llu, %s", lb_kind_name(d->kind),
                     (unsigned long long)d->count, lb_type_name(d->dtype));
    if (k < 0 || (size_t)k >= n) return;
    if (lb_kind(d->kind)->has_op) k += snprintf(out + k, n - (size_t)k, ", %s", lb_op_name(d->op));
    if ((size_t)k < n && lb_kind(d->kind)->has_root)
        k += snprintf(out + k, n - (size_t)k, ", root=%d", d->root);
    if ((size_t)k < n) snprintf(out + k, n - (size_t)k, ")");
}

static int desc_equal(const struct lbw_desc *a, const struct lbw_desc *b) {
    if (a->seq != b->seq || a->kind != b->kind || a->count != b->count || a->dtype != b->dtype)
        return 0;
    if (lb_kind(a->kind)->has_op) {
        /* user PreMulSum ops are per-communicator handles: compare the class only */
        int ua = a->op >= ncclNumOps, ub = b->op >= ncclNumOps;
        if (ua != ub || (!ua && a->op != b->op)) return 0;
    }
    if (lb_kind(a->kind)->has_root && a->root != b->root) return 0;
    return 1;
}

static ncclResult_t compare_descs(struct lb_comm *c, uint64_t seq) {
    const struct lbw_desc *mine = &c->ranks[c->rank].desc[seq & 1];
    for (int s = 0; s < c->nranks; s++) {
        if (s == c->rank) continue;
        const struct lbw_desc *theirs = &c->ranks[s].desc[seq & 1];
        if (desc_equal(mine, theirs)) continue;
        char a[160], b[160];
        describe(a, sizeof a, mine);
        describe(b, sizeof b, theirs);
        int rlo = c->rank < s ? c->rank : s, rhi = c->rank < s ? s : c->rank;
        lbw_break(c, ncclInvalidUsage, 1,
                  "mismatched collectives at collective #%llu of communicator %llx: rank %d called "
                  "nccl%s but rank %d called nccl%s",
                  (unsigned long long)seq, (unsigned long long)c->hash, rlo,
                  c->rank < s ? a : b, rhi, c->rank < s ? b : a);
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

#define CHECK(expr)                                   \
    do {                                              \
        ncclResult_t r_ = (expr);                     \
        if (r_ != ncclSuccess) return r_;             \
    } while (0)

/* ---- direct mode: read the peers' buffers where they are ----------------------------
 * When all ranks are threads of this process, a collective is: post a descriptor with
 * the buffer addresses, barrier, pull what this rank needs straight from the peers'
 * buffers, barrier (the peers' buffers must stay untouched until everyone pulled).
 * AllReduce reduces its own slice first and pulls the other slices from their owners'
 * receive buffers after a middle barrier. No staging copies, three waits at most.
 * (Between processes, process_vm_readv would allow the same, but it copies at about
 * half memcpy's speed here, so two memcpys through the slots win.) */

static inline const void *at(uint64_t addr, size_t off) {
    return (const char *)(uintptr_t)addr + off;
}

/* Every rank's PreMulSum scalar (posted in its descriptor for collective seq), in rank order. */
static const uint64_t *rank_scalars(struct lb_comm *c, uint64_t seq) {
    for (int s = 0; s < c->nranks; s++) c->scalars[s] = c->ranks[s].desc[seq & 1].scalar;
    return c->scalars;
}

/* The rest of a direct-mode collective, after the descriptor barrier of step 3g+1. */
static ncclResult_t exec_direct(struct lb_comm *c, const struct lb_op *op, uint64_t seq,
                                uint64_t g) {
    const uint64_t *scalars = rank_scalars(c, seq);
    const int R = c->nranks, me = c->rank, root = op->root, kind = op->kind;
    const size_t E = lb_type_size(op->dtype), count = op->count, nb = count * E;
    const char *what = lb_kind_name(kind);
    const char *sb = (const char *)op->sbuf;
    char *rb = (char *)op->rbuf;
#define SB(s) (c->ranks[s].desc[seq & 1].sbuf)
#define RB(s) (c->ranks[s].desc[seq & 1].rbuf)
    char *tmp = NULL;
    ncclResult_t r = ncclSuccess;
    switch (kind) {
    case LB_K_ALLREDUCE: {
        size_t q = (count + (size_t)R - 1) / (size_t)R;
        q = (q + 15) / 16 * 16;
        size_t lo = (size_t)me * q < count ? (size_t)me * q : count;
        size_t hi = lo + q < count ? lo + q : count;
        for (int s = 0; s < R; s++) c->srcs[s] = at(SB(s), lo * E);
        if (hi > lo) lb_reduce(op->dtype, &op->rop, scalars, NULL, rb + lo * E, c->srcs, R, hi - lo);
        set_step(c, 3 * g + 2);
        if ((r = wait_steps(c, -1, 3 * g + 2, what)) != ncclSuccess) break;
        for (int j = 0; j < R; j++) {
            size_t jl = (size_t)j * q < count ? (size_t)j * q : count;
            size_t jh = jl + q < count ? jl + q : count;
            if (j != me && jh > jl) memcpy(rb + jl * E, at(RB(j), jl * E), (jh - jl) * E);
        }
        break;
    }
    case LB_K_REDUCE:
        if (me == root) {
            for (int s = 0; s < R; s++) c->srcs[s] = at(SB(s), 0);
            lb_reduce(op->dtype, &op->rop, scalars, NULL, rb, c->srcs, R, count);
        }
        break;
    case LB_K_REDUCESCATTER:
        for (int s = 0; s < R; s++) c->srcs[s] = at(SB(s), (size_t)me * nb);
        lb_reduce(op->dtype, &op->rop, scalars, NULL, rb, c->srcs, R, count);
        break;
    case LB_K_BROADCAST:
        if (rb != at(SB(root), 0)) memcpy(rb, at(SB(root), 0), nb);
        break;
    case LB_K_ALLGATHER:
        for (int j = 0; j < R; j++)
            if (rb + (size_t)j * nb != at(SB(j), 0)) memcpy(rb + (size_t)j * nb, at(SB(j), 0), nb);
        break;
    case LB_K_ALLTOALL: {
        /* in place, a peer may still read the segment this rank overwrites: stage */
        char *out = rb;
        if (sb == rb && R > 1) {
            if (!(tmp = malloc((size_t)R * nb))) {
                r = lb_err(ncclSystemError, "loopback: out of memory for an in-place AlltoAll");
                break;
            }
            out = tmp;
        }
        for (int j = 0; j < R; j++) {
            const void *src = at(SB(j), (size_t)me * nb);
            if (out + (size_t)j * nb != src) memcpy(out + (size_t)j * nb, src, nb);
        }
        break;
    }
    case LB_K_GATHER:
        for (int j = 0; j < R && me == root; j++)
            if (rb + (size_t)j * nb != at(SB(j), 0)) memcpy(rb + (size_t)j * nb, at(SB(j), 0), nb);
        break;
    case LB_K_SCATTER:
        if (rb != at(SB(root), (size_t)me * nb)) memcpy(rb, at(SB(root), (size_t)me * nb), nb);
        break;
    default:
        r = lb_err(ncclInternalError, "loopback: unknown collective kind %d", kind);
        break;
    }
#undef SB
#undef RB
    if (r == ncclSuccess) {
        /* everyone has pulled from this rank's buffers once all reach 3g+3 */
        set_step(c, 3 * g + 3);
        r = wait_steps(c, -1, 3 * g + 3, what);
        if (r == ncclSuccess && tmp) memcpy(rb, tmp, (size_t)R * nb);
    }
    free(tmp);
    return r;
}

static ncclResult_t exec_staged(struct lb_comm *c, const struct lb_op *op, uint64_t seq);


/* Every collective starts by posting its descriptor and waiting for everyone's: the
 * mismatch check, and the choice between direct mode and staging through the slots. */
ncclResult_t lbx_exec_coll(struct lb_comm *c, const struct lb_op *op) {
    const size_t E = lb_type_size(op->dtype);
    uint64_t scalar = op->rop.scalar;
    if (op->rop.kind == LB_R_PREMULSUM && op->rop.scalar_is_ptr)
        memcpy(&scalar, op->rop.scalar_ptr, E); /* device scalar: read when the op runs */
    if (!c->probed) { /* direct mode needs every rank in this process */
        c->probed = 1;
        bool direct;
        lb_env_bool("PYNCCL_LOOPBACK_DIRECT", true, &direct, NULL, 0);
        c->direct = direct;
        for (int s = 0; s < c->nranks; s++) c->direct &= c->ranks[s].pid == c->pid;
    }
    lb_ras_count(c, op->kind);
    const uint64_t seq = ++c->cseq, g = c->gchunk++;
    struct lbw_desc *d = &c->ranks[c->rank].desc[seq & 1];
    d->count = op->count;
    d->kind = op->kind;
    d->dtype = op->dtype;
    d->op = op->api_op;
    d->root = op->root;
    d->sbuf = (uint64_t)(uintptr_t)op->sbuf;
    d->rbuf = (uint64_t)(uintptr_t)op->rbuf;
    d->direct = (uint32_t)c->direct;
    d->scalar = scalar;
    d->seq = seq;
    set_step(c, 3 * g + 1);
    CHECK(wait_steps(c, -1, 3 * g + 1, lb_kind_name(op->kind)));
    CHECK(compare_descs(c, seq));
    int direct = 1;
    for (int s = 0; s < c->nranks; s++) direct &= c->ranks[s].desc[seq & 1].direct == 1;
    if (direct) return exec_direct(c, op, seq, g);
    set_step(c, 3 * g + 3); /* the preamble used this step; the slots start at the next */
    return exec_staged(c, op, seq);
}

static ncclResult_t exec_staged(struct lb_comm *c, const struct lb_op *op, uint64_t seq) {
    const uint64_t *scalars = rank_scalars(c, seq);
    const int R = c->nranks, me = c->rank, root = op->root, kind = op->kind;
    const size_t E = lb_type_size(op->dtype), count = op->count;
    /* a send buffer of one segment per rank (ReduceScatter, AlltoAll, Scatter) */
    const int send_span = lb_kind(kind)->send;
    const int sub = send_span == LB_SPAN_ALL || send_span == LB_SPAN_ROOT_ALL;
    const size_t per = sub ? c->slot_bytes / ((size_t)R * E) : c->slot_bytes / E;
    const size_t nch = count ? (count + per - 1) / per : 1;
    const char *sb = (const char *)op->sbuf;
    char *rb = (char *)op->rbuf;
    const char *what = lb_kind_name(kind);

    for (size_t k = 0; k < nch; k++) {
        const uint64_t g = c->gchunk++;
        const size_t o = k * per, n = count ? (count - o < per ? count - o : per) : 0;
        const size_t nb = n * E;
        if (g >= 2) CHECK(wait_steps(c, -1, 3 * g - 3, what)); /* buffer g%2 free again */
        /* slices of the chunk for AllReduce / Reduce, 16-element aligned */
        size_t q = (n + (size_t)R - 1) / (size_t)R;
        q = (q + 15) / 16 * 16;

        /* phase 1: fill */
        switch (kind) {
        case LB_K_ALLREDUCE:
        case LB_K_REDUCE:
            for (int j = 0; j < R; j++) {
                size_t lo = (size_t)j * q, hi = lo + q < n ? lo + q : n;
                if (j == me || lo >= hi) continue;
                memcpy(slot(c, g, me) + lo * E, sb + (o + lo) * E, (hi - lo) * E);
            }
            break;
        case LB_K_BROADCAST:
            if (me == root && nb) {
                if (R > 1) memcpy(slot(c, g, me), sb + o * E, nb);
                if (sb != rb) memcpy(rb + o * E, sb + o * E, nb);
            }
            break;
        case LB_K_ALLGATHER:
            if (nb) {
                if (R > 1) memcpy(slot(c, g, me), sb + o * E, nb);
                char *mine = rb + ((size_t)me * count + o) * E;
                if (sb + o * E != mine) memcpy(mine, sb + o * E, nb);
            }
            break;
        case LB_K_REDUCESCATTER:
            for (int j = 0; j < R && nb; j++)
                if (j != me)
                    memcpy(slot(c, g, me) + (size_t)j * per * E, sb + ((size_t)j * count + o) * E, nb);
            break;
        case LB_K_ALLTOALL:
            for (int j = 0; j < R && nb; j++) {
                const char *src = sb + ((size_t)j * count + o) * E;
                if (j != me) {
                    memcpy(slot(c, g, me) + (size_t)j * per * E, src, nb);
                } else {
                    char *dst = rb + ((size_t)j * count + o) * E;
                    if (dst != src) memcpy(dst, src, nb);
                }
            }
            break;
        case LB_K_GATHER:
            if (nb) {
                if (me != root) {
                    memcpy(slot(c, g, me), sb + o * E, nb);
                } else {
                    char *mine = rb + ((size_t)root * count + o) * E;
                    if (mine != sb + o * E) memcpy(mine, sb + o * E, nb);
                }
            }
            break;
        case LB_K_SCATTER:
            if (me == root && nb) {
                for (int j = 0; j < R; j++) {
                    const char *src = sb + ((size_t)j * count + o) * E;
                    if (j != me) {
                        memcpy(slot(c, g, me) + (size_t)j * per * E, src, nb);
                    } else if (rb + o * E != src) {
                        memcpy(rb + o * E, src, nb);
                    }
                }
            }
            break;
        default:
            return lb_err(ncclInternalError, "loopback: unknown collective kind %d", kind);
        }
        set_step(c, 3 * g + 1);

        /* who must have filled before this rank reads */
        int who = -1;
        int need_wait = 1;
        {
            if (kind == LB_K_BROADCAST || kind == LB_K_SCATTER) {
                who = root;
                need_wait = me != root;
            } else if (kind == LB_K_GATHER) {
                need_wait = me == root;
            }
        }
        if (need_wait) CHECK(wait_steps(c, who, 3 * g + 1, what));

        /* phase 2: reduce */
        if (kind == LB_K_ALLREDUCE || kind == LB_K_REDUCE) {
            size_t lo = (size_t)me * q, hi = lo + q < n ? lo + q : n;
            if (lo < hi) {
                for (int s = 0; s < R; s++)
                    c->srcs[s] = s == me ? (const void *)(sb + (o + lo) * E)
                                         : (const void *)(slot(c, g, s) + lo * E);
                int to_rb = kind == LB_K_ALLREDUCE || me == root;
                int to_slot = R > 1 && (kind == LB_K_ALLREDUCE || me != root);
                lb_reduce(op->dtype, &op->rop, scalars, to_slot ? slot(c, g, me) + lo * E : NULL,
                          to_rb ? rb + (o + lo) * E : NULL, c->srcs, R, hi - lo);
            }
            set_step(c, 3 * g + 2);
            if (kind == LB_K_ALLREDUCE || me == root) CHECK(wait_steps(c, -1, 3 * g + 2, what));
        } else if (kind == LB_K_REDUCESCATTER) {
            if (n) {
                for (int s = 0; s < R; s++)
                    c->srcs[s] = s == me ? (const void *)(sb + ((size_t)me * count + o) * E)
                                         : (const void *)(slot(c, g, s) + (size_t)me * per * E);
                lb_reduce(op->dtype, &op->rop, scalars, NULL, rb + o * E, c->srcs, R, n);
            }
        }

        /* phase 3: drain */
        switch (kind) {
        case LB_K_ALLREDUCE:
        case LB_K_REDUCE:
            if (kind == LB_K_ALLREDUCE || me == root) {
                for (int j = 0; j < R; j++) {
                    size_t lo = (size_t)j * q, hi = lo + q < n ? lo + q : n;
                    if (j == me || lo >= hi) continue;
                    memcpy(rb + (o + lo) * E, slot(c, g, j) + lo * E, (hi - lo) * E);
                }
            }
            break;
        case LB_K_BROADCAST:
            if (me != root && nb) memcpy(rb + o * E, slot(c, g, root), nb);
            break;
        case LB_K_ALLGATHER:
            for (int j = 0; j < R && nb; j++)
                if (j != me) memcpy(rb + ((size_t)j * count + o) * E, slot(c, g, j), nb);
            break;
        case LB_K_ALLTOALL:
            for (int j = 0; j < R && nb; j++)
                if (j != me)
                    memcpy(rb + ((size_t)j * count + o) * E, slot(c, g, j) + (size_t)me * per * E,
                           nb);
            break;
        case LB_K_GATHER:
            if (me == root)
                for (int j = 0; j < R && nb; j++)
                    if (j != me) memcpy(rb + ((size_t)j * count + o) * E, slot(c, g, j), nb);
            break;
        case LB_K_SCATTER:
            if (me != root && nb) memcpy(rb + o * E, slot(c, g, root) + (size_t)me * per * E, nb);
            break;
        default:
            break;
        }
        set_step(c, 3 * g + 3);
    }
    return ncclSuccess;
}
