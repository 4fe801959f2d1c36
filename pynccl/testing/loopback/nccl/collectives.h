/*
 * The loopback libnccl's one table of operations: every collective and point-to-point
 * kind, once. Everything per kind is generated from it: the kind numbers (enum lb_kind),
 * their names, whether they take a root / a reduction op, how many bytes each rank's send
 * and receive buffers span (core.c), and the entry points ncclAllReduce ... ncclScatter
 * with their *Config variants (enqueue.c).
 *
 * LB_COLLECTIVES(X): X(Name, KIND, since, config_since, args, count, send, recv)
 *   Name          ncclName / ncclNameConfig, and the kind's name in messages
 *   KIND          LB_K_KIND
 *   since         the first release exporting ncclName: ALWAYS, or 2_28_3 (LB_SINCE_2_28_3)
 *   config_since  the first release exporting ncclNameConfig
 *   args          the parameters between datatype and comm: NONE, OP (ncclRedOp_t op),
 *                 ROOT (int root) or OP_ROOT (both): also whether the kind has a root / op
 *   count         the count parameter's name in nccl.h
 *   send, recv    bytes the rank's buffer spans: NB (count elements), ALL (count x nranks),
 *                 ROOT_NB / ROOT_ALL (those on the root, nothing elsewhere)
 *
 * LB_P2P(X): X(Name, KIND, send, recv) for ncclSend / ncclRecv (a peer instead of a
 * root; their entry points, with one buffer each, are written out in enqueue.c).
 * Collectives come first: kind < LB_K_SEND is a collective.
 */
#ifndef PYNCCL_LB_COLLECTIVES_H
#define PYNCCL_LB_COLLECTIVES_H

#define LB_COLLECTIVES(X)                                                              \
    X(AllReduce, ALLREDUCE, ALWAYS, 2_31_2, OP, count, NB, NB)                         \
    X(Broadcast, BROADCAST, ALWAYS, 2_31_2, ROOT, count, ROOT_NB, NB)                  \
    X(Reduce, REDUCE, ALWAYS, 2_31_2, OP_ROOT, count, NB, ROOT_NB)                     \
    X(AllGather, ALLGATHER, ALWAYS, 2_31_2, NONE, sendcount, NB, ALL)                  \
    X(ReduceScatter, REDUCESCATTER, ALWAYS, 2_31_2, OP, recvcount, ALL, NB)            \
    X(AlltoAll, ALLTOALL, 2_28_3, 2_31_2, NONE, count, ALL, ALL)                       \
    X(Gather, GATHER, 2_28_3, 2_31_2, ROOT, count, NB, ROOT_ALL)                       \
    X(Scatter, SCATTER, 2_28_3, 2_31_2, ROOT, count, ROOT_ALL, NB)

#define LB_P2P(X)                   \
    X(Send, SEND, NB, ZERO)     \
    X(Recv, RECV, ZERO, NB)

/* LB_SINCE_<release>(text): text in builds of that release or later, nothing before. */
#define LB_SINCE_ALWAYS(...) __VA_ARGS__
#if LB_AT_LEAST(2, 28, 3)
#define LB_SINCE_2_28_3(...) __VA_ARGS__
#else
#define LB_SINCE_2_28_3(...)
#endif
#if LB_AT_LEAST(2, 31, 2)
#define LB_SINCE_2_31_2(...) __VA_ARGS__
#else
#define LB_SINCE_2_31_2(...)
#endif

/* The args column: parameters, the op and root values an lb_op gets, and the rules. */
#define LB_PARAMS_NONE
#define LB_PARAMS_OP , ncclRedOp_t op
#define LB_PARAMS_ROOT , int root
#define LB_PARAMS_OP_ROOT , ncclRedOp_t op, int root
#define LB_OPV_NONE -1
#define LB_OPV_OP (int)op
#define LB_OPV_ROOT -1
#define LB_OPV_OP_ROOT (int)op
#define LB_ROOTV_NONE -1
#define LB_ROOTV_OP -1
#define LB_ROOTV_ROOT root
#define LB_ROOTV_OP_ROOT root
#define LB_HAS_OP_NONE 0
#define LB_HAS_OP_OP 1
#define LB_HAS_OP_ROOT 0
#define LB_HAS_OP_OP_ROOT 1
#define LB_HAS_ROOT_NONE 0
#define LB_HAS_ROOT_OP 0
#define LB_HAS_ROOT_ROOT 1
#define LB_HAS_ROOT_OP_ROOT 1

enum lb_kind {
#define LB_X_KIND(Name, KIND, ...) LB_K_##KIND,
    LB_COLLECTIVES(LB_X_KIND) LB_P2P(LB_X_KIND)
#undef LB_X_KIND
    LB_K_COUNT
};

/* How many bytes of a rank's buffer an operation touches (the send / recv columns). */
enum lb_span { LB_SPAN_ZERO, LB_SPAN_NB, LB_SPAN_ALL, LB_SPAN_ROOT_NB, LB_SPAN_ROOT_ALL };

struct lb_kind_info {
    const char *name;
    unsigned char has_root, has_op, p2p; /* p2p: root is the peer */
    unsigned char send, recv;            /* enum lb_span */
};

#endif
