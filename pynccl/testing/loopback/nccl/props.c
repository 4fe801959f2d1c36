/*
 * The host functions of nccl_device/host.h in the loopback libnccl:
 * ncclCommQueryProperties, the team functions and the window pointer queries.
 *
 * Every rank of a loopback communicator can load and store every other rank's window
 * (window.c), so the LSA team is the whole world and there is one rail of one
 * rank. There is no device API, multicast, GIN or CFT: the properties say so.
 */
#include "internal.h"

#include <string.h>

#if LB_AT_LEAST(2, 28, 3)
static ncclTeam_t team_of(ncclComm_t comm, int rail) {
    ncclTeam_t t = {0, 0, 0};
    struct lb_comm *c;
    if (lb_comm_get(comm, rail ? "ncclTeamRail" : "ncclTeamWorld", &c) != ncclSuccess) return t;
    if (rail) {
        t.nRanks = 1;
        t.rank = 0;
        t.stride = c->nranks;
    } else {
        t.nRanks = c->nranks;
        t.rank = c->rank;
        t.stride = 1;
    }
    return t;
}

ncclTeam_t ncclTeamWorld(ncclComm_t comm) { return team_of(comm, 0); }
LB_ALIAS(ncclTeamWorld)

ncclTeam_t ncclTeamLsa(ncclComm_t comm) { return team_of(comm, 0); }
LB_ALIAS(ncclTeamLsa)

ncclTeam_t ncclTeamRail(ncclComm_t comm) { return team_of(comm, 1); }
LB_ALIAS(ncclTeamRail)

/* World rank of team member `rank`: my world rank moved by (rank - my team rank) strides. */
int ncclTeamRankToWorld(ncclComm_t comm, ncclTeam_t team, int rank) {
    struct lb_comm *c;
    if (lb_comm_get(comm, "ncclTeamRankToWorld", &c) != ncclSuccess) return -1;
    return c->rank + (rank - team.rank) * team.stride;
}
LB_ALIAS(ncclTeamRankToWorld)

/* LSA rank of team member `rank` (the LSA team is the world here). */
int ncclTeamRankToLsa(ncclComm_t comm, ncclTeam_t team, int rank) {
    struct lb_comm *c;
    if (lb_comm_get(comm, "ncclTeamRankToLsa", &c) != ncclSuccess) return -1;
    return c->rank + (rank - team.rank) * team.stride;
}
LB_ALIAS(ncclTeamRankToLsa)
#endif

#if LB_AT_LEAST(2, 29, 2)
/* Store field `f` only when the caller's struct (props->size bytes) has room for it. */
#define LB_PUT(f, v)                                                                      \
    do {                                                                                  \
        if (offsetof(ncclCommProperties_t, f) + sizeof(props->f) <= size) props->f = (v); \
    } while (0)

ncclResult_t ncclCommQueryProperties(ncclComm_t comm, ncclCommProperties_t *props) {
    const char *opname = "ncclCommQueryProperties";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if (props == NULL) return lb_err(ncclInvalidArgument, "%s : props argument is NULL", opname);
    if ((r = lb_comm_ensure_ready(c, opname)) != ncclSuccess) return r;
    if (props->magic != NCCL_API_MAGIC)
        return lb_err(ncclInvalidUsage,
                      "Cannot get communicator properties: ncclCommProperties_t argument must be "
                      "initialized via NCCL_COMM_PROPERTIES_INITIALIZER");
    if (props->version > LB_NCCL_VERSION_CODE)
        return lb_err(ncclInvalidUsage,
                      "NCCL library is too old. This application was compiled with NCCL version "
                      "%u.%u.%u, but is running with NCCL library version %d.%d.%d.",
                      props->version / 10000, props->version / 100 % 100, props->version % 100,
                      LB_NCCL_VERSION_CODE / 10000, LB_NCCL_VERSION_CODE / 100 % 100,
                      LB_NCCL_VERSION_CODE % 100);
    size_t size = props->size;
    LB_PUT(rank, c->rank);
    LB_PUT(nRanks, c->nranks);
    LB_PUT(cudaDev, c->dev);
    LB_PUT(nvmlDev, c->dev);
    LB_PUT(deviceApiSupport, 0);
    LB_PUT(multimemSupport, 0);
    if (props->version > LB_V(2, 29, 3)) { /* NCCL fills these for newer callers only */
        LB_PUT(ginType, 0);
        LB_PUT(nLsaTeams, 1);
        /* NCCL: numRmaCtx > 0 and symmetric memory with one LSA team, which every
         * loopback world is; ncclPutSignal/Signal/WaitSignal refuse host RMA without it */
        LB_PUT(hostRmaSupport, c->rma_ctx > 0);
        LB_PUT(railedGinType, 0);
    }
    LB_PUT(commHash, c->hash);
    LB_PUT(ginMinStride, 0);
    LB_PUT(ginConnectionType, 0);
    if (offsetof(ncclCommProperties_t, ginSupport) + sizeof props->ginSupport <= size)
        memset(props->ginSupport, 0, sizeof props->ginSupport);
    LB_PUT(devCommRuntimeVersionSize, 0);
    LB_PUT(cftSupport, 0);
    LB_PUT(cftMulticastSupport, 0);
    LB_PUT(cftCountedSupport, 0);
    return ncclSuccess;
}
LB_ALIAS(ncclCommQueryProperties)
#undef LB_PUT
#endif

#if LB_AT_LEAST(2, 29, 2)
/* ---- window pointers ------------------------------------------------------------------------ */

/* Checks shared by the pointer queries; *nranks, *base and *size describe `peer`'s window. */
static ncclResult_t window_of(ncclWindow_t window, void **outPtr, int peer, const char *opname,
                              int *nranks, char **base, size_t *size) {
    if (window == NULL) return lb_err(ncclInvalidArgument, "%s : window argument is NULL", opname);
    if (outPtr == NULL) return lb_err(ncclInvalidArgument, "%s : outPtr argument is NULL", opname);
    if (!lb_win_peer(window, peer, nranks, base, size))
        return lb_err(ncclInvalidArgument, "%s : Could not find communicator matching window %p",
                      opname, (void *)window);
    return ncclSuccess;
}

static ncclResult_t peer_pointer(ncclWindow_t window, size_t offset, int peer, void **outPtr,
                                 const char *opname, int lsa) {
    int nranks = 0;
    char *base = NULL;
    size_t size = 0;
    ncclResult_t r = window_of(window, outPtr, peer, opname, &nranks, &base, &size);
    if (r != ncclSuccess) return r;
    if (peer < 0 || peer >= nranks) {
        if (lsa)
            return lb_err(ncclInvalidArgument,
                          "%s : The provided lsaRank %d is not in the valid lsaSize of [0,%d] for "
                          "the provided window %p.",
                          opname, peer, nranks, (void *)window);
        return lb_err(ncclInvalidArgument, "%s : peer %d is not within valid range of ranks %d.",
                      opname, peer, nranks);
    }
    if (offset >= size)
        return lb_err(ncclInvalidArgument, "%s : offset %zu is beyond rank %d's window of %zu bytes",
                      opname, offset, peer, size);
    *outPtr = base + offset;
    return ncclSuccess;
}

/* Every rank can load/store every other rank's window here: the LSA team is the world. */
ncclResult_t ncclGetLsaDevicePointer(ncclWindow_t window, size_t offset, int lsaRank, void **outPtr) {
    return peer_pointer(window, offset, lsaRank, outPtr, "ncclGetLsaDevicePointer", 1);
}
LB_ALIAS(ncclGetLsaDevicePointer)

ncclResult_t ncclGetPeerDevicePointer(ncclWindow_t window, size_t offset, int peer, void **outPtr) {
    return peer_pointer(window, offset, peer, outPtr, "ncclGetPeerDevicePointer", 0);
}
LB_ALIAS(ncclGetPeerDevicePointer)

/* No multicast (NVLS) in the loopback: NCCL answers NULL then. */
ncclResult_t ncclGetLsaMultimemDevicePointer(ncclWindow_t window, size_t offset, void **outPtr) {
    int n;
    char *b;
    size_t s;
    (void)offset;
    ncclResult_t r = window_of(window, outPtr, -1, "ncclGetLsaMultimemDevicePointer", &n, &b, &s);
    if (r == ncclSuccess) *outPtr = NULL;
    return r;
}
LB_ALIAS(ncclGetLsaMultimemDevicePointer)

ncclResult_t ncclGetMultimemDevicePointer(ncclWindow_t window, size_t offset,
                                          ncclMultimemHandle_t multimem, void **outPtr) {
    const char *opname = "ncclGetMultimemDevicePointer";
    int n;
    char *b;
    size_t s;
    (void)offset;
    ncclResult_t r = window_of(window, outPtr, -1, opname, &n, &b, &s);
    if (r != ncclSuccess) return r;
    if (multimem.mcBasePtr == NULL)
        return lb_err(ncclInvalidArgument, "%s : MCBasePtr %p needs to be valid.", opname,
                      multimem.mcBasePtr);
    *outPtr = NULL;
    return ncclSuccess;
}
LB_ALIAS(ncclGetMultimemDevicePointer)
#endif
