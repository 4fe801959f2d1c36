/*
 * User buffer registration and user reduction ops of the loopback libnccl:
 * ncclCommRegister / ncclCommDeregister, ncclRedOpCreatePreMulSum / ncclRedOpDestroy.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- memory ------------------------------------------------------------------------------ */

#if LB_AT_LEAST(2, 19, 1)
/* ncclMemAlloc / ncclMemFree: window.c */

ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
    const char *opname = "ncclCommRegister";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if ((r = lb_comm_ensure_ready(c, opname)) != ncclSuccess) return r;
    if (buff == NULL || size == 0 || handle == NULL)
        return lb_err(ncclInvalidArgument, "%s : invalid buffer %p, size %zu or handle %p", opname,
                      buff, size, (void *)handle);
    int dev = -1;
    if (c->strict && !pynccl_lb_find_alloc(buff, size, &dev))
        return lb_err(ncclInvalidArgument,
                      "%s : buffer %p (%zu bytes) does not lie inside a loopback device "
                      "allocation",
                      opname, buff, size);
    struct lb_reg *reg = calloc(1, sizeof *reg);
    if (!reg) return lb_err(ncclSystemError, "%s : out of memory", opname);
    reg->buff = buff;
    reg->size = size;
    pthread_mutex_lock(&c->mu);
    reg->next = c->regs;
    c->regs = reg;
    pthread_mutex_unlock(&c->mu);
    *handle = reg;
    return ncclSuccess;
}
LB_ALIAS(ncclCommRegister)

ncclResult_t ncclCommDeregister(const ncclComm_t comm, void *handle) {
    const char *opname = "ncclCommDeregister";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    pthread_mutex_lock(&c->mu);
    for (struct lb_reg **pp = &c->regs; *pp; pp = &(*pp)->next) {
        if (*pp == handle) {
            struct lb_reg *reg = *pp;
            *pp = reg->next;
            pthread_mutex_unlock(&c->mu);
            free(reg);
            return ncclSuccess;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return lb_err(ncclInvalidArgument, "%s : handle %p is not registered with communicator %p",
                  opname, handle, (void *)comm);
}
LB_ALIAS(ncclCommDeregister)
#endif

/* ---- user reduction ops -------------------------------------------------------------------- */

#if LB_AT_LEAST(2, 11, 4)
ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
    const char *opname = "ncclRedOpCreatePreMulSum";
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    if ((r = lb_comm_ensure_ready(c, opname)) != ncclSuccess) return r;
    if (op == NULL) return lb_err(ncclInvalidArgument, "%s : op argument is NULL", opname);
    if (scalar == NULL) return lb_err(ncclInvalidArgument, "%s : scalar argument is NULL", opname);
    if ((int)datatype < 0 || (int)datatype >= LB_NUM_TYPES)
        return lb_err(ncclInvalidArgument, "%s : invalid type %d", opname, (int)datatype);
    if (residence != ncclScalarDevice && residence != ncclScalarHostImmediate)
        return lb_err(ncclInvalidArgument, "%s : invalid scalar residence %d", opname,
                      (int)residence);
    size_t E = lb_type_size(datatype);
    if (residence == ncclScalarDevice && c->strict && !pynccl_lb_find_alloc(scalar, E, NULL))
        return lb_err(ncclInvalidArgument,
                      "%s : device scalar %p does not lie inside a loopback device allocation",
                      opname, scalar);
    pthread_mutex_lock(&c->mu);
    int idx = 0;
    while (idx < c->nuops && c->uops[idx].used) idx++;
    if (idx == c->nuops) {
        int cap = c->nuops ? 2 * c->nuops : 4;
        struct lb_userop *u = realloc(c->uops, (size_t)cap * sizeof *u);
        if (!u) {
            pthread_mutex_unlock(&c->mu);
            return lb_err(ncclSystemError, "%s : out of memory", opname);
        }
        memset(u + c->nuops, 0, (size_t)(cap - c->nuops) * sizeof *u);
        c->uops = u;
        c->nuops = cap;
    }
    struct lb_userop *u = &c->uops[idx];
    u->used = 1;
    u->dtype = (int)datatype;
    u->residence = (int)residence;
    u->imm = 0;
    u->ptr = NULL;
    if (residence == ncclScalarHostImmediate)
        memcpy(&u->imm, scalar, E);
    else
        u->ptr = scalar;
    pthread_mutex_unlock(&c->mu);
    *op = (ncclRedOp_t)(LB_NUM_OPS + idx);
    return ncclSuccess;
}
LB_ALIAS(ncclRedOpCreatePreMulSum)

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
    const char *opname = "ncclRedOpDestroy";
    if ((int)op >= 0 && (int)op < LB_NUM_OPS)
        return lb_err(ncclInvalidArgument, "%s : operator is a NCCL builtin.", opname);
    if ((int)op < 0) return lb_err(ncclInvalidArgument, "%s :  operator is garbage.", opname);
    if (comm == NULL) return lb_err(ncclInvalidArgument, "%s : invalid communicator passed.", opname);
    struct lb_comm *c;
    ncclResult_t r = lb_comm_get(comm, opname, &c);
    if (r != ncclSuccess) return r;
    int idx = (int)op - LB_NUM_OPS;
    pthread_mutex_lock(&c->mu);
    int ok = idx < c->nuops && c->uops[idx].used;
    if (ok) c->uops[idx].used = 0;
    pthread_mutex_unlock(&c->mu);
    if (!ok) return lb_err(ncclInvalidArgument, "%s : operator unknown to this communicator.", opname);
    return ncclSuccess;
}
LB_ALIAS(ncclRedOpDestroy)
#endif
