/*
 * ncclCommSuspend / ncclCommResume / ncclCommMemStats (2.29) of the loopback libnccl.
 *
 * The communicator's internal "device" memory is its world (world.c): a
 * persistent control part (header, rank records, ring counters) and a data part (the
 * collective slots and the p2p ring buffers) that only holds data while an operation
 * runs. Each rank accounts for its share: the control part divided by the ranks, and
 * its own two slots plus the rings it sends on; the shares add up to the world.
 *
 * Suspend (collective in NCCL: every rank calls it) waits for the rank's operations,
 * then refuses new ones until Resume with ncclInvalidUsage. When the last rank has
 * suspended, every rank is idle and the data part's pages are given back to the
 * system (MADV_REMOVE punches them out of the shared memory; the ring buffers only
 * when no sent message waits to be received). The first rank to resume reserves them
 * again (MADV_POPULATE_WRITE, so that exhausted memory is an error here rather than
 * a SIGBUS in a collective).
 *
 * ncclCommMemStats reports the tracked totals, as NCCL's memory manager does
 * (src/mem_manager.cc): suspending releases memory without changing them; only
 * ncclStatGpuMemSuspended says whether the comm is suspended. Like NCCL, suspend and
 * resume refuse a communicator whose memory is shared (splitShare / shrinkShare with a
 * live child or parent) with ncclInvalidUsage.
 */
#include "internal.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef NCCL_SUSPEND_MEM
#define NCCL_SUSPEND_MEM 0x01
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

enum { LB_REL_SLOTS = 1, LB_REL_RINGS = 2 };

#if LB_AT_LEAST(2, 29, 7)

static int rings_empty(const struct lb_comm *c) {
    for (size_t i = 0; i < (size_t)c->nranks * (size_t)c->nranks; i++)
        if (__atomic_load_n(&c->rings[i].head, __ATOMIC_ACQUIRE) !=
            __atomic_load_n(&c->rings[i].tail, __ATOMIC_ACQUIRE))
            return 0;
    return 1;
}

/* [from, to) of the world for the released parts in mask. */
static void released_range(const struct lb_comm *c, uint32_t mask, size_t *from, size_t *to) {
    const struct lbw_hdr *w = c->w;
    *from = mask & LB_REL_SLOTS ? w->slots_off : w->ringdata_off;
    *to = mask & LB_REL_RINGS ? w->size : w->ringdata_off;
}

static ncclResult_t get_ready(ncclComm_t comm, const char *opname, struct lb_comm **out) {
    ncclResult_t r = lb_comm_get(comm, opname, out);
    if (r != ncclSuccess) return r;
    if (__atomic_load_n(&(*out)->state, __ATOMIC_ACQUIRE) != LBC_READY || !(*out)->w)
        return lb_err(ncclInvalidArgument,
                      "%s : Attempt to use communicator before the previous operation returned "
                      "ncclSuccess",
                      opname);
    return ncclSuccess;
}

/* NCCL refuses to release a memory manager other communicators use too. */
static ncclResult_t shared_memory(struct lb_comm *c, const char *what) {
    int refs = __atomic_load_n(c->mm_refs, __ATOMIC_ACQUIRE);
    if (refs <= 1) return ncclSuccess;
    return lb_err(ncclInvalidUsage,
                  "Memory %s not supported with split_share communicators (refCount=%d)", what,
                  refs);
}

ncclResult_t ncclCommSuspend(ncclComm_t comm, int flags) {
    const char *opname = "ncclCommSuspend";
    struct lb_comm *c;
    ncclResult_t r = get_ready(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (flags != NCCL_SUSPEND_MEM)
        return lb_err(ncclInvalidArgument, "%s : invalid flags 0x%x (NCCL_SUSPEND_MEM is 0x%x)",
                      opname, (unsigned)flags, (unsigned)NCCL_SUSPEND_MEM);
    if ((r = shared_memory(c, "suspend")) != ncclSuccess) return r;
    if (__atomic_load_n(&c->suspended, __ATOMIC_ACQUIRE))
        return lb_err(ncclInvalidUsage, "%s : communicator %p is already suspended", opname,
                      (void *)comm);
    if ((r = lb_comm_ensure_ready(c, opname)) != ncclSuccess) return r;
    lb_comm_drain(c);
    __atomic_store_n(&c->suspended, 1, __ATOMIC_RELEASE);
    struct lbw_hdr *w = c->w;
    if ((int)__atomic_add_fetch(&w->nsuspended, 1, __ATOMIC_SEQ_CST) == c->nranks) {
        /* every rank is idle: give the data part's pages back */
        uint32_t mask = LB_REL_SLOTS | (rings_empty(c) ? LB_REL_RINGS : 0);
        size_t from, to;
        released_range(c, mask, &from, &to);
        if (madvise((char *)w + from, to - from, MADV_REMOVE) == 0)
            __atomic_store_n(&w->released, mask, __ATOMIC_RELEASE);
    }
    return ncclSuccess;
}
LB_ALIAS(ncclCommSuspend)

ncclResult_t ncclCommResume(ncclComm_t comm) {
    const char *opname = "ncclCommResume";
    struct lb_comm *c;
    ncclResult_t r = get_ready(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if ((r = shared_memory(c, "resume")) != ncclSuccess) return r;
    if (!__atomic_load_n(&c->suspended, __ATOMIC_ACQUIRE))
        return lb_err(ncclInvalidUsage, "%s : communicator %p is not suspended", opname,
                      (void *)comm);
    struct lbw_hdr *w = c->w;
    uint32_t mask = __atomic_exchange_n(&w->released, 0, __ATOMIC_ACQ_REL);
    if (mask) {
        size_t from, to;
        released_range(c, mask, &from, &to);
        int e = lbw_populate((char *)w + from, to - from);
        if (e != 0) {
            __atomic_store_n(&w->released, mask, __ATOMIC_RELEASE);
            return lb_err(ncclSystemError,
                          "%s : cannot reserve the communicator's %zu bytes of shared memory "
                          "again: %s (is the memory limit reached?)",
                          opname, to - from, strerror(e));
        }
    }
    __atomic_sub_fetch(&w->nsuspended, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&c->suspended, 0, __ATOMIC_RELEASE);
    return ncclSuccess;
}
LB_ALIAS(ncclCommResume)

ncclResult_t ncclCommMemStats(ncclComm_t comm, ncclCommMemStat_t stat, uint64_t *value) {
    const char *opname = "ncclCommMemStats";
    struct lb_comm *c;
    ncclResult_t r = get_ready(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (value == NULL) return lb_err(ncclInvalidArgument, "%s : value argument is NULL", opname);
    const struct lbw_hdr *w = c->w;
    const uint64_t R = (uint64_t)c->nranks;
    /* tracked totals: a release while suspended does not change them */
    uint64_t persist = w->slots_off / R;
    uint64_t slots = 2 * w->slot_bytes;
    uint64_t rings = R * w->ring_bytes;
    switch ((int)stat) {
    case ncclStatGpuMemSuspend: *value = slots + rings; break;
    case ncclStatGpuMemSuspended: *value = (uint64_t)__atomic_load_n(&c->suspended, __ATOMIC_ACQUIRE); break;
    case ncclStatGpuMemPersist: *value = persist; break;
    case ncclStatGpuMemTotal: *value = persist + slots + rings; break;
    default:
        return lb_err(ncclInvalidArgument,
                      "%s : invalid stat %d (ncclStatGpuMemSuspend, ncclStatGpuMemSuspended, "
                      "ncclStatGpuMemPersist or ncclStatGpuMemTotal)",
                      opname, (int)stat);
    }
    return ncclSuccess;
}
LB_ALIAS(ncclCommMemStats)

#endif
