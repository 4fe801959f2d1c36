/*
 * Collective and point-to-point entry points of the loopback libnccl: the argument
 * checks NCCL makes (comm, readiness, root/peer, type, op, sizes, and - the loopback's
 * strict mode - that each buffer lies inside a loopback allocation on the comm's
 * device), synchronously; then the op goes into the thread's group or is launched at
 * once as a group of one (launch.c). The collectives' entry points and *Config variants
 * are generated from LB_COLLECTIVES (collectives.h).
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- argument checks -------------------------------------------------------------------- */

static ncclResult_t resolve_op(struct lb_comm *c, struct lb_op *op, const char *opname) {
    int api = op->api_op, dt = op->dtype;
    struct lb_redop *r = &op->rop;
    memset(r, 0, sizeof *r);
    r->api_op = api;
    if (api < 0) return lb_err(ncclInvalidArgument, "%s : invalid reduction operation %d", opname, api);
    if (api < LB_NUM_OPS) {
        switch (api) {
        case ncclSum: r->kind = LB_R_SUM; break;
        case ncclProd: r->kind = LB_R_PROD; break;
        case ncclMax: r->kind = LB_R_MAX; break;
        case ncclMin: r->kind = LB_R_MIN; break;
        default: /* ncclAvg: NCCL's SumPostDiv for integers, PreMulSum(1/n) for floats */
            if (lb_type_is_float(dt)) {
                r->kind = LB_R_PREMULSUM;
                r->scalar = lb_scalar_from_double(dt, 1.0 / c->nranks);
            } else {
                r->kind = LB_R_SUMPOSTDIV;
                r->divisor = c->nranks;
            }
            break;
        }
        return ncclSuccess;
    }
    int idx = api - LB_NUM_OPS;
    pthread_mutex_lock(&c->mu);
    int known = idx < c->nuops && c->uops[idx].used;
    struct lb_userop u;
    if (known) u = c->uops[idx];
    pthread_mutex_unlock(&c->mu);
    if (!known)
        return lb_err(ncclInvalidArgument, "%s : reduction operation %d unknown to this communicator",
                      opname, api);
    if (u.dtype != dt)
        return lb_err(ncclInvalidArgument,
                      "%s : Data type supplied to user-created ncclRedOp_t does not match type "
                      "given to reduction operation (%s vs %s)",
                      opname, lb_type_name(dt), lb_type_name(u.dtype));
    r->kind = LB_R_PREMULSUM;
    r->scalar = u.imm;
    r->scalar_is_ptr = u.residence == ncclScalarDevice;
    r->scalar_ptr = u.ptr;
    return ncclSuccess;
}

static ncclResult_t check_buf(const struct lb_comm *c, const void *p, size_t bytes,
                              const char *name, const char *opname) {
    if (bytes == 0) return ncclSuccess;
    if (p == NULL) return lb_err(ncclInvalidArgument, "%s : %s argument is NULL", opname, name);
    if (!c->strict) return ncclSuccess;
    int dev = -1;
    if (!pynccl_lb_find_alloc(p, bytes, &dev))
        return lb_err(ncclInvalidArgument,
                      "%s : %s %p (%zu bytes) does not lie inside a loopback device allocation "
                      "(cudaMalloc / ncclMemAlloc); set PYNCCL_LOOPBACK_STRICT=0 to allow host "
                      "memory",
                      opname, name, p, bytes);
    if (dev != c->dev)
        return lb_err(ncclInvalidArgument, "%s : %s allocated on device %d mismatchs with NCCL device %d",
                      opname, name, dev, c->dev);
    return ncclSuccess;
}

static ncclResult_t check_args(struct lb_comm *c, struct lb_op *op, cudaStream_t stream,
                               const char *opname) {
    ncclResult_t r = lb_comm_ensure_ready(c, opname);
    if (r != ncclSuccess) return r;
    const int R = c->nranks, me = c->rank;
    const struct lb_kind_info *kind = lb_kind(op->kind);
    const int p2p = kind->p2p;
    if (p2p || kind->has_root) {
        if (op->root < 0 || op->root >= R)
            return lb_err(ncclInvalidArgument, "%s : invalid %s %d (%s should be in the 0..%d range)",
                          opname, p2p ? "peer" : "root", op->root, p2p ? "peer" : "root", R - 1);
    } else {
        op->root = -1;
    }
    if ((int)op->dtype < 0 || (int)op->dtype >= LB_NUM_TYPES)
        return lb_err(ncclInvalidArgument, "%s : invalid type %d (NCCL %d.%d.%d has %d types)",
                      opname, (int)op->dtype, LB_NCCL_VERSION_CODE / 10000,
                      LB_NCCL_VERSION_CODE / 100 % 100, LB_NCCL_VERSION_CODE % 100, LB_NUM_TYPES);
    if (kind->has_op) {
        if ((r = resolve_op(c, op, opname)) != ncclSuccess) return r;
    } else {
        memset(&op->rop, 0, sizeof op->rop);
        op->rop.kind = LB_R_SUM;
        op->api_op = -1;
    }
    size_t E = lb_type_size(op->dtype), nb, all;
    if (__builtin_mul_overflow(op->count, E, &nb) || __builtin_mul_overflow(nb, (size_t)R, &all) ||
        all > (size_t)PTRDIFF_MAX)
        return lb_err(ncclInvalidArgument, "%s : count %zu of %s overflows the address space", opname,
                      op->count, lb_type_name(op->dtype));
    const int is_root = me == op->root;
    size_t s = lb_span_bytes(kind->send, nb, all, is_root);
    size_t rv = lb_span_bytes(kind->recv, nb, all, is_root);
    if ((r = check_buf(c, op->sbuf, s, "sendbuff", opname)) != ncclSuccess) return r;
    if ((r = check_buf(c, op->rbuf, rv, "recvbuff", opname)) != ncclSuccess) return r;
    return lb_check_stream(c, stream, opname);
}

static ncclResult_t submit(struct lb_comm *c, cudaStream_t stream, const struct lb_op *op,
                           const char *opname) {
    if (op->kind < LB_K_SEND && op->count == 0) return ncclSuccess; /* NCCL drops empty ones */
#if LB_NULL
    (void)c;
    (void)stream;
    (void)opname;
    return ncclSuccess;
#else
    struct lb_gitem it;
    memset(&it, 0, sizeof it);
    it.type = LBG_OP;
    it.c = c;
    it.stream = stream;
    it.op = *op;
    if (lb_group_depth() > 0) {
        ncclResult_t r = lb_group_join_mode(c->blocking, opname);
        if (r != ncclSuccess) return r;
        return lb_group_push(&it);
    }
    if (!c->blocking) { /* NCCL: an implicit group, whose end is non-blocking */
        struct lb_gitem *one = malloc(sizeof *one);
        if (!one) return lb_err(ncclSystemError, "%s : out of memory", opname);
        *one = it;
        lb_comm_ref(c);
        return lb_launch_async(one, 1, NULL, 0);
    }
    int idx = 0;
    return lb_enqueue_task(c, &it, &idx, 1);
#endif
}

/* Whether both of op's buffers lie in windows registered NCCL_WIN_COLL_SYMMETRIC (what
 * NCCL's symmetric kernels need): for the TUNING line, asked only when it prints. */
static int in_symmetric_windows(struct lb_comm *c, const struct lb_op *op) {
    if (op->kind >= LB_K_SEND || !lb_info_on(LB_DBG_TUNING)) return 0;
    size_t bytes = op->count * lb_type_size(op->dtype);
    size_t sbytes = op->kind == LB_K_REDUCESCATTER ? bytes * (size_t)c->nranks : bytes;
    size_t rbytes = op->kind == LB_K_ALLGATHER ? bytes * (size_t)c->nranks : bytes;
    pthread_mutex_lock(&c->mu);
    int sym = lb_win_find(c, op->sbuf, sbytes, 0x01 /* NCCL_WIN_COLL_SYMMETRIC */) &&
              lb_win_find(c, op->rbuf, rbytes, 0x01);
    pthread_mutex_unlock(&c->mu);
    return sym;
}

static ncclResult_t run_op(struct lb_op *op, ncclComm_t comm, cudaStream_t stream,
                           const char *opname) {
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r == ncclSuccess) r = check_args(c, op, stream, opname);
    if (r == ncclSuccess) lb_info_coll(c, op, opname, stream, in_symmetric_windows(c, op));
    if (r == ncclSuccess) r = submit(c, stream, op, opname);
    return lb_group_error(r);
}

static struct lb_op mkop(int kind, const void *s, void *r, size_t count, ncclDataType_t dt, int op,
                         int root) {
    struct lb_op o;
    memset(&o, 0, sizeof o);
    o.kind = kind;
    o.sbuf = s;
    o.rbuf = r;
    o.count = count;
    o.dtype = (int)dt;
    o.api_op = op;
    o.root = root;
    return o;
}

/* ---- the API -------------------------------------------------------------------------- */

/* ncclAllReduce ... ncclScatter, one per row of LB_COLLECTIVES (collectives.h). */
#define LB_X_ENTRY(Name, KIND, since, config_since, args, count, send, recv)                 \
    LB_SINCE_##since(                                                                       \
        ncclResult_t nccl##Name(const void *sendbuff, void *recvbuff, size_t count,         \
                                ncclDataType_t datatype LB_PARAMS_##args, ncclComm_t comm,  \
                                cudaStream_t stream) {                                      \
            struct lb_op o = mkop(LB_K_##KIND, sendbuff, recvbuff, count, datatype,         \
                                  LB_OPV_##args, LB_ROOTV_##args);                          \
            return run_op(&o, comm, stream, #Name);                                         \
        } LB_ALIAS(nccl##Name))
LB_COLLECTIVES(LB_X_ENTRY)
#undef LB_X_ENTRY

/* The legacy in-place broadcast. */
ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
                       ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_BROADCAST, buff, buff, count, datatype, -1, root);
    return run_op(&o, comm, stream, "Broadcast");
}
LB_ALIAS(ncclBcast)

#if LB_AT_LEAST(2, 7, 3)
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_SEND, sendbuff, NULL, count, datatype, -1, peer);
    return run_op(&o, comm, stream, "Send");
}
LB_ALIAS(ncclSend)

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
    struct lb_op o = mkop(LB_K_RECV, NULL, recvbuff, count, datatype, -1, peer);
    return run_op(&o, comm, stream, "Recv");
}
LB_ALIAS(ncclRecv)
#endif

/* ---- the 2.31+ *Config variants ------------------------------------------------------------
 * 2.31.2 rejected size < 64 and copied 64 bytes; 2.32.3 copies min(size, 72). Both check
 * forceAlgSelection and CTAPolicy; NULL means the plain call. */

#if LB_AT_LEAST(2, 31, 2)
#if LB_AT_LEAST(2, 32, 0)
#define LB_COLLCONFIG_SIZE sizeof(ncclCollConfig_t)
#else
#define LB_COLLCONFIG_SIZE offsetof(ncclCollConfig_t, launchCompletionEvent)
#endif

static ncclResult_t coll_config(const ncclCollConfig_t *cfg, struct lb_op *op, const char *opname) {
    if (cfg == NULL) return ncclSuccess;
    size_t size;
    memcpy(&size, &cfg->size, sizeof size);
#if !LB_AT_LEAST(2, 32, 0)
    if (size < LB_COLLCONFIG_SIZE)
        return lb_err(ncclInvalidArgument, "%s : ncclCollConfig_t size %zu is smaller than %zu",
                      opname, size, (size_t)LB_COLLCONFIG_SIZE);
#endif
    ncclCollConfig_t c;
    memset(&c, 0, sizeof c);
    c.forceAlgSelection = 1;
    c.CTAPolicy = NCCL_CONFIG_UNDEF_INT;
    memcpy(&c, cfg, size < LB_COLLCONFIG_SIZE ? size : LB_COLLCONFIG_SIZE);
    if (c.magic != NCCL_API_MAGIC)
        return lb_err(ncclInvalidArgument,
                      "%s : ncclCollConfig_t argument not initialized via "
                      "NCCL_COLLCONFIG_INITIALIZER (magic 0x%x)",
                      opname, c.magic);
    if (c.forceAlgSelection != 0 && c.forceAlgSelection != 1)
        return lb_err(ncclInvalidArgument, "%s : Invalid collConfig forceAlgSelection value %d",
                      opname, c.forceAlgSelection);
    if (c.CTAPolicy != NCCL_CONFIG_UNDEF_INT && (c.CTAPolicy < 0 || c.CTAPolicy > 3))
        return lb_err(ncclInvalidArgument, "%s : Invalid collConfig CTAPolicy value %d", opname,
                      c.CTAPolicy);
#if LB_AT_LEAST(2, 32, 0)
    if (size >= sizeof(ncclCollConfig_t)) op->launch_event = c.launchCompletionEvent;
#else
    (void)op;
#endif
    return ncclSuccess;
}

static ncclResult_t run_op_config(struct lb_op *op, ncclComm_t comm, cudaStream_t stream,
                                  const ncclCollConfig_t *cfg, const char *opname) {
    ncclResult_t r = coll_config(cfg, op, opname);
    if (r != ncclSuccess) return lb_group_error(r);
    return run_op(op, comm, stream, opname);
}

/* ncclAllReduceConfig ... ncclScatterConfig, one per row of LB_COLLECTIVES. */
#define LB_X_CONFIG(Name, KIND, since, config_since, args, count, send, recv)                \
    LB_SINCE_##config_since(                                                                \
        ncclResult_t nccl##Name##Config(const void *sendbuff, void *recvbuff, size_t count, \
                                        ncclDataType_t datatype LB_PARAMS_##args,           \
                                        ncclComm_t comm, cudaStream_t stream,               \
                                        const ncclCollConfig_t *config) {                   \
            struct lb_op o = mkop(LB_K_##KIND, sendbuff, recvbuff, count, datatype,         \
                                  LB_OPV_##args, LB_ROOTV_##args);                          \
            return run_op_config(&o, comm, stream, config, #Name);                          \
        } LB_ALIAS(nccl##Name##Config))
LB_COLLECTIVES(LB_X_CONFIG)
#undef LB_X_CONFIG
#endif
