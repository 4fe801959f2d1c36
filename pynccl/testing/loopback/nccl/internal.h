/*
 * Private to the loopback libnccl (the nccl/ sources): shared types and helpers.
 * The files and their order, bottom to top, head core.c.
 *
 * Locking: a communicator's mu guards its task counters, refs, user ops and
 * registrations; it is never held while waiting on other ranks. The executor state
 * (gchunk, cseq, nexec) is touched only by the task that holds the comm's turn.
 */
#ifndef PYNCCL_NCCL_LB_INTERNAL_H
#define PYNCCL_NCCL_LB_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <sys/types.h>

#include "lb_internal.h"
#include "lb_nccl.h"

#pragma GCC visibility push(hidden)

#define LBN_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define LBN_UNUSED __attribute__((unused))

/* pnccl* aliases, as NCCL exports them (profiling interposition). */
#define LB_ALIAS(name) \
    extern __typeof__(name) p##name __attribute__((alias(#name), visibility("default")));

#ifndef LB_NULL
#define LB_NULL 0
#endif

/* ---- numerics (reduce.c) ---------------------------------------------------- */

enum lb_rkind { LB_R_SUM, LB_R_PROD, LB_R_MAX, LB_R_MIN, LB_R_PREMULSUM, LB_R_SUMPOSTDIV };

/* A reduction as executed: resolved at call time (NCCL copies the op state at
 * enqueue too, so a user op may be destroyed while the collective is queued). */
struct lb_redop {
    int kind;          /* enum lb_rkind */
    int api_op;        /* the ncclRedOp_t the caller passed, for messages */
    int scalar_is_ptr; /* PREMULSUM: scalar read from scalar_ptr when the op runs */
    const void *scalar_ptr;
    uint64_t scalar;   /* PREMULSUM immediate: an element of the op's type, little-endian */
    int divisor;       /* SUMPOSTDIV */
};

size_t lb_type_size(int dtype);
const char *lb_type_name(int dtype);
int lb_type_is_float(int dtype);
/* The element of type dtype nearest to v (round to nearest even), as raw bits. */
uint64_t lb_scalar_from_double(int dtype, double v);
/* dst1/dst2 (either may be NULL) = srcs[0] op srcs[1] op ... op srcs[nsrc-1], element
 * by element, in that order, rounding to the type after every step. A destination
 * may alias a source element for element (in-place). For PreMulSum, scalars[r] is the
 * scalar of the rank that contributed srcs[r] (each rank scales its own input, as in
 * NCCL); other ops ignore scalars (may be NULL). */
void lb_reduce(int dtype, const struct lb_redop *op, const uint64_t *scalars, void *dst1,
               void *dst2, const void *const *srcs, int nsrc, size_t n);

struct lb_op {
    int kind; /* enum lb_kind */
    int dtype;
    int root; /* peer for send/recv; -1 when unused */
    int api_op;
    size_t count;
    const void *sbuf;
    void *rbuf;
    struct lb_redop rop;
    cudaEvent_t launch_event; /* ncclCollConfig_t.launchCompletionEvent (2.32) */
};

/* ---- shared memory world (world.c) ------------------------------------- */

#define LBW_MAGIC 0x314457424c4e4350ULL /* "PCNLBWD1" */
#define LBW_LAYOUT 3
#define LBW_SHM_PREFIX "pynccl-lb-"
#define LB_CACHELINE 64

enum lbw_rank_state { LBR_EMPTY = 0, LBR_JOINED = 1, LBR_LEFT = 2, LBR_FAILED = 3 };

#include "collectives.h" /* enum lb_kind, struct lb_kind_info */
#include "ras.h"         /* the RAS report (ras_fmt.c) */

/* What each rank posts for its current collective, compared by every rank. */
struct lbw_desc {
    uint64_t seq; /* collective number + 1 */
    uint64_t count;
    int32_t kind, dtype, op, root;
    uint64_t sbuf, rbuf; /* addresses in the rank's process (direct mode) */
    uint32_t direct;     /* 1: this rank would read its peers' buffers in place */
    uint64_t scalar;     /* PreMulSum: this rank's scalar, as raw bits of the op's type */
};

/* A rank's post for window registration round `seq` (window.c). */
struct lbw_winpost {
    uint64_t seq;  /* round posted, 1-based */
    uint64_t read; /* last round this rank has read everyone's post of */
    uint64_t addr, size, fdoff;
    int32_t fd, flags, kind, status; /* kind 1 register, 2 deregister; status: local error */
};

struct lbw_rank {
    int32_t pid;
    int32_t device;
    uint32_t state; /* enum lbw_rank_state */
    int32_t phys; /* the physical device behind `device` (CUDA_VISIBLE_DEVICES may differ) */
    uint64_t split_post; /* number of the split whose color/key are posted below */
    int32_t split_color, split_key;
    uint64_t split_read; /* last split this rank has read everyone's post of */
    uint64_t cstep __attribute__((aligned(LB_CACHELINE))); /* collective phase counter */
    struct lbw_desc desc[2] __attribute__((aligned(LB_CACHELINE)));
    struct lbw_winpost win __attribute__((aligned(LB_CACHELINE))); /* window.c */
    uint64_t enc_hash; /* ncclSetEncryption key digest (crypto.c), 0 = none */
    /* 1 once this rank entered a non-abort ncclCommFinalize/Destroy (teardown.c) */
    uint32_t teardown __attribute__((aligned(LB_CACHELINE)));
    /* collectives this rank started, per NCCL function (ras.c; RAS's collective_counts) */
    uint64_t ras_counts[LB_RAS_NFUNCS] __attribute__((aligned(LB_CACHELINE)));
};

/* One direction of a p2p channel: bytes written by the sender and consumed by the
 * receiver, each on its own cache line. */
struct lbw_ring {
    uint64_t head __attribute__((aligned(LB_CACHELINE)));
    uint64_t tail __attribute__((aligned(LB_CACHELINE)));
};

struct lbw_hdr {
    uint64_t magic; /* LBW_MAGIC once the creator has filled the header */
    uint32_t layout;
    int32_t nranks;
    uint64_t size;
    uint64_t slot_bytes, ring_bytes;
    uint64_t ranks_off, rings_off, slots_off, ringdata_off;
    int32_t creator_pid;
    int32_t lib_version;
    /* one-sided signals (signal.c): uint64 counts [receiver][ctx][sig][sender] */
    uint64_t sig_off;
    int32_t rma_nctx, rma_nsig;
    uint32_t joined __attribute__((aligned(LB_CACHELINE)));
    uint32_t epoch __attribute__((aligned(LB_CACHELINE))); /* futex word: bumped on progress */
    uint32_t waiters;
    uint32_t broken __attribute__((aligned(LB_CACHELINE))); /* 0 or the ncclResult_t others get */
    int32_t broken_rank;
    uint32_t broken_msg_ready;
    char broken_msg[512];
    /* ncclCommSuspend: ranks suspended now; 1 while the data region is released */
    uint32_t nsuspended __attribute__((aligned(LB_CACHELINE)));
    uint32_t released;
    /* ncclCommGrow: the root posts grow number grow_seq's id for the other ranks */
    uint64_t grow_seq __attribute__((aligned(LB_CACHELINE)));
    unsigned char grow_uid[NCCL_UNIQUE_ID_BYTES];
};

/* ---- communicators (comm.c) ------------------------------------------------------ */

enum lb_comm_state { LBC_JOINING = 0, LBC_READY = 1, LBC_FAILED = 2 };

/* Why a communicator's operations stopped (lb_comm.stopped). */
enum lb_stop { LB_STOP_NONE = 0, LB_STOP_REVOKED = 1, LB_STOP_SHRUNK = 2 };

struct lb_userop {
    int used;
    int dtype;
    int residence;
    uint64_t imm;
    const void *ptr;
};

struct lb_reg {
    struct lb_reg *next;
    void *buff;
    size_t size;
};

struct lb_split;

struct lb_comm {
    struct ncclComm *handle;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs; /* mu */

    int rank, nranks, dev;
    pid_t pid;
    unsigned char uid[NCCL_UNIQUE_ID_BYTES];
    char shm_name[96]; /* "/pynccl-lb-<hex>": the rendezvous and memfd name */
    int rv_fd, seg_fd; /* the creator's listening socket and memfd until all joined */
    uint64_t hash; /* for messages */

    /* the mapped world and pointers into it */
    struct lbw_hdr *w;
    size_t wsize;
    struct lbw_rank *ranks;
    struct lbw_ring *rings;
    char *slots, *ringdata;
    unsigned char *p2p_conn; /* per peer: this rank's ring to it is reserved (p2p.c) */
    size_t slot_bytes, ring_bytes;
    const void **srcs; /* nranks scratch pointers for the executor */
    uint64_t *scalars; /* nranks PreMulSum scalars, in rank order, for the executor */
    int probed;
    int direct;        /* collectives read peers' buffers directly (all ranks in-process) */

    /* config */
    int blocking, strict, split_share, shrink_share;
    const char *comm_name;

    /* state */
    int state;        /* enum lb_comm_state, atomic */
    int async;        /* ncclResult_t, atomic */
    int halt;         /* atomic: pending and future tasks do nothing */
    int aborted;      /* atomic */
    int cancel;       /* atomic: waits give up (revoke / abortive shrink, until quiescent) */
    int finalized;
    int finalize_called; /* NCCL's: finalize or revoke ran; destroy/abort skip its waits */
    int nb_polls_left;
    uint64_t init_deadline_ns;
    uint64_t init_start_ns, init_report_ns, init_next_report_ns; /* initwait.c */
    struct lb_comm *joining_next; /* the process's comms still joining (initwait.c) */

    /* tasks (mu) */
    uint64_t issued, completed;
    uint64_t retired; /* tasks that ran, or were dropped, whatever their order */
    int running;
    size_t fifo_used, fifo_cap; /* the work queue, in NCCL work-FIFO bytes (launch.c) */
    int graph_refs;   /* live CUDA-graph copies of captured tasks (NCCL: localPersistentRefs) */
    struct lb_gjob *gjob; /* a non-blocking group end or finalize in flight (gjob.c) */
    int poison;       /* atomic: what the polls read until gjob ends (a call refused meanwhile) */
    int *mm_refs;     /* communicators sharing this one's memory (split_share), shared count */

    /* executor state: only the task holding the turn touches these */
    uint64_t gchunk, cseq, nexec;
    uint64_t last_sweep_ns;      /* executor's peer check */
    uint64_t last_poll_sweep_ns; /* ncclCommGetAsyncError's */

    /* fault injection (PYNCCL_LOOPBACK_*) */
    long long fail_after;
    int fail_code;
    long long hang_at;

    /* user reduction ops and registrations (mu) */
    struct lb_userop *uops;
    int nuops;
    struct lb_reg *regs;

    /* fault tolerance and suspend (fault.c, suspend.c) */
    int stopped;     /* atomic: 0, or why operations stopped (enum lb_stop) */
    int suspended;   /* atomic: ncclCommSuspend(NCCL_SUSPEND_MEM) until ncclCommResume */
    uint64_t nshrinks, ngrows;
    int grow_pending; /* an id from ncclCommGetUniqueId not yet consumed by ncclCommGrow */
    unsigned char grow_uid[NCCL_UNIQUE_ID_BYTES];

    /* windows and signals (window.c, signal.c) */
    int rma_ctx, rma_sig;    /* numRmaCtx / numRmaSig of the config (world sizes) */
    uint64_t *sig;           /* the world's signal counts */
    uint64_t *sig_waited;    /* [ctx][sig][sender]: counts already consumed by waits */
    struct lb_win *wins;     /* registered windows (mu) */
    int rma_running;         /* signal tasks executing (mu) */
    uint64_t win_rounds;     /* registration rounds done */

    /* splits of this comm as a parent */
    uint64_t nsplits;
    int nb_pending; /* nonblocking splits of this parent still in progress (g_splits_mu) */
};

#define LB_HANDLE_LIVE 0x4c42434f4d4d4c56ULL
#define LB_HANDLE_DEAD 0x4c42434f4d4d4444ULL

/* The ncclComm_t users hold. Never freed (kept reachable from a global list), so
 * that a destroyed handle is recognised instead of being a use-after-free. */
struct ncclComm {
    uint64_t magic;
    struct lb_comm *c;
    struct ncclComm *next_all;
};

/* Split in progress (stages: posted -> gathered and joined -> ready). */
struct lb_split {
    struct lb_split *next;
    struct lb_comm *parent; /* ref held */
    uint64_t seq;
    int color, key;
    ncclComm_t *out;
    int stage;            /* 0 posted, 1 child joining (or no child), 2 done */
    struct lb_comm *child; /* created at stage 1 unless NOCOLOR */
    int have_config;
    ncclConfig_t config;  /* parsed child config, or the parent's */
};

/* last error / logging */
void lb_set_error(const char *fmt, ...) LBN_PRINTF(1, 2);
void lb_vset_error(const char *fmt, va_list ap);
ncclResult_t lb_err(ncclResult_t r, const char *fmt, ...) LBN_PRINTF(2, 3);

/* communicator helpers */
ncclResult_t lb_comm_get(ncclComm_t comm, const char *opname, struct lb_comm **out);
ncclResult_t lb_comm_ensure_ready(struct lb_comm *c, const char *opname);
/* The same, but a revoked comm (once quiescent) is ready: split and shrink may use it. */
ncclResult_t lb_comm_ensure_ready_revoked(struct lb_comm *c, const char *opname);
void lb_comm_ref(struct lb_comm *c);
void lb_comm_unref(struct lb_comm *c);
/* Set the async error (first one wins), stop pending work, tell the other ranks. */
void lb_comm_fail(struct lb_comm *c, ncclResult_t code, const char *fmt, ...) LBN_PRINTF(3, 4);
/* Advance a joining communicator; blocking waits until it is ready or failed. */
ncclResult_t lb_comm_progress(struct lb_comm *c, int blocking);
/* Advance a split; blocking waits. Returns InProgress while not done. */
ncclResult_t lb_split_progress(struct lb_split *s, int blocking);
/* Group end, first pass: gather the posts and join the child world (no waiting for it). */
ncclResult_t lb_split_stage_join(struct lb_split *s);
/* Drop a split (abandoning a child comm not yet handed out) and its parent ref. */
void lb_split_free(struct lb_split *s);
/* A nonblocking split: completed by polls of any communicator's async error (NCCL does
 * it in a background thread; here every poll in the process pushes every split on). */
void lb_split_defer(struct lb_split *s);
uint64_t lb_now_ns(void);
long long lb_env_ll(const char *name, long long dflt);
void lb_comm_halt(struct lb_comm *c);
/* Wait until every task issued on c has retired (run, or been dropped; a halted comm's
 * tasks retire as their streams reach them) and none runs (teardown.c). */
void lb_comm_drain(struct lb_comm *c);
void lb_make_uid(unsigned char *uid);
int lb_uid_valid(const unsigned char *uid);
uint64_t lb_mix64(uint64_t x);
/* The id of a child world: the parent's id with its random parts salted. */
void lb_derive_uid(const unsigned char *parent, uint64_t salt, unsigned char *uid);
ncclResult_t lb_parse_config(const ncclConfig_t *user, ncclConfig_t *out, const char *opname);
void lb_config_of(const struct lb_comm *c, ncclConfig_t *cfg);
ncclResult_t lb_fail_init_injected(const char *opname);
/* Create rank `rank` of a world and, outside a group, wait for it (blocking) or
 * return ncclInProgress: the tail of every init (InitRank, Shrink, Grow). */
ncclResult_t lb_comm_start(const unsigned char *uid, int nranks, int rank, int dev,
                           const ncclConfig_t *cfg, const char *opname, ncclComm_t *newcomm);

/* streams (comm.c): NULL, cudaStreamLegacy or cudaStreamPerThread */
int lb_is_default_stream(cudaStream_t s);
/* ncclUnhandledCudaError for a stream that is not a live loopback stream; with strict
 * checks, ncclInvalidArgument for one of another device than the communicator's. */
ncclResult_t lb_check_stream(const struct lb_comm *c, cudaStream_t stream, const char *opname);

/* fault tolerance and suspend (fault.c, suspend.c) */
/* ncclInvalidUsage while the comm is revoked, shrunk with NCCL_SHRINK_ABORT or suspended. */
ncclResult_t lb_comm_check_stopped(struct lb_comm *c, const char *opname);
/* Every task the comm issued has retired, and no signal task runs (1), or not (0). */
int lb_comm_quiescent(struct lb_comm *c);
/* A revoked comm's async state: its error, else ncclInProgress until quiescent. */
ncclResult_t lb_comm_revoke_state(struct lb_comm *c);

/* transport */
ncclResult_t lbw_join(struct lb_comm *c, const char *opname);
int lbw_all_joined(struct lb_comm *c);
ncclResult_t lbw_check_joined(struct lb_comm *c, const char *opname);

/* ---- comms waiting for their world to fill (initwait.c) --------------------------- */

void lb_joining_add(struct lb_comm *c);
void lb_joining_remove(struct lb_comm *c);
void lb_init_report_setup(struct lb_comm *c);
void lb_init_report(struct lb_comm *c, const char *opname, int timed_out);
LB_EXPORT int pynccl_lb_init_missing(const unsigned char *uid, int *missing, int cap, int *nranks);
ncclResult_t lbw_wait_joined(struct lb_comm *c, const char *opname);
/* Tell the other ranks this one left (state: LBR_LEFT or LBR_FAILED, first one wins);
 * leave also unmaps the world (at the last reference: a call may still be waiting in it). */
void lbw_depart(struct lb_comm *c, enum lbw_rank_state state);
void lbw_leave(struct lb_comm *c, enum lbw_rank_state state);
void lbw_notify(struct lb_comm *c);
/* Mark the world broken (first caller wins): other ranks adopt `code`. set_local also
 * makes the message this process's last error. */
void lbw_break(struct lb_comm *c, ncclResult_t code, int set_local, const char *fmt, ...)
    LBN_PRINTF(4, 5);
/* The error a healthy rank adopts when the world is broken, or ncclSuccess. */
ncclResult_t lbw_broken(struct lb_comm *c);
ncclResult_t lbw_peer_sweep(struct lb_comm *c, uint64_t *last_ns);
/* 0 once process `pid` is gone (exited, or a zombie nobody reaped yet). */
int lbw_pid_alive(pid_t pid);

/* ---- NCCL's RAS service (ras.c) ------------------------------------------------------ */
/* A new communicator: the first one starts the listener unless NCCL_RAS_ENABLE=0.
 * remove (at teardown, and before the comm is freed) forgets it, and stops the listener
 * with the last one; the listener reads a comm only under the registry's lock. */
void lb_ras_comm_add(struct lb_comm *c);
void lb_ras_comm_remove(struct lb_comm *c);
/* This rank starts a collective of `kind` (enum lb_kind). */
void lb_ras_count(struct lb_comm *c, int kind);
ncclResult_t lbw_split_post(struct lb_comm *c, uint64_t seq, int color, int key);
/* Non-blocking unless blocking: 1 with colors/keys filled once everyone posted. */
ncclResult_t lbw_split_gather(struct lb_comm *c, uint64_t seq, int *colors, int *keys,
                              int blocking, int *done);
/* Wait until ready(c, arg), re-evaluated on every wake-up, with the checks of every
 * wait (abort/revoke, broken world, dead peers). */
ncclResult_t lbw_wait_until(struct lb_comm *c, int (*ready)(struct lb_comm *, void *), void *arg,
                            const char *what);
/* Close the creator's rendezvous socket and memfd (once all joined, or on leave). */
void lbw_rendezvous_close(struct lb_comm *c);
int lbw_populate(char *p, size_t n);
/* Reserve this rank's ring to `peer` before its first send is queued (p2p.c). */
ncclResult_t lb_p2p_connect(struct lb_comm *c, int peer);
/* Executors, run on a stream worker. Return ncclSuccess, or an error already recorded
 * in the comm's async error (LB_ABORTED when the comm was aborted). */
#define LB_ABORTED ((ncclResult_t)-1)
ncclResult_t lbx_exec_coll(struct lb_comm *c, const struct lb_op *op);
ncclResult_t lbx_exec_p2p(struct lb_comm *c, const struct lb_op *ops, int n);
ncclResult_t lbx_hang(struct lb_comm *c);

/* Wait until ready(c, arg, &blocker) returns nonzero, watching for aborts, broken worlds
 * and a blocker rank (set by ready, or -1) that left. Returns ncclSuccess, LB_ABORTED,
 * or an error already recorded as the last error. */
typedef int (*lbw_ready_fn)(struct lb_comm *c, void *arg, int *blocker);
ncclResult_t lbw_wait_for(struct lb_comm *c, lbw_ready_fn ready, void *arg, const char *what);

/* ---- windows, signals, properties, encryption ------------------------------------ */

/* window.c: ncclMemAlloc memory and the window objects. */
#define LB_WIN_MAGIC 0x4e49574c42434e50ULL
struct lb_win { /* an ncclWindow_t */
    uint64_t magic;
    struct lb_win *next;  /* the comm's list (c->mu) */
    struct lb_win *gnext; /* every live window (g_win_mu) */
    struct lb_comm *c;
    char *user;
    size_t size;
    int flags, nranks;
    char **peer;     /* each rank's window as addressed from this process */
    size_t *psize;   /* each rank's window size */
    void **maps;     /* mappings of peers' memfds (NULL where the peer is in-process) */
    size_t *maplens;
    char *mapreg;    /* 1 where the cudart knows maps[p] as device memory */
};

/* The memfd and offset backing [p, p + bytes), if it lies in one ncclMemAlloc block. */
int lb_mem_find(const void *p, size_t bytes, int *fd, size_t *off);
void lb_win_free(struct lb_win *w); /* unmaps the peers; w must be unlinked */
/* Make w->maps[peer] device memory of `device` for the cudart's checks (window.c). */
void lb_win_map_register(struct lb_win *w, int peer, int device);
void lb_win_publish(struct lb_comm *c, struct lb_win *w);
void lb_win_unlink(struct lb_comm *c, struct lb_win *w);
/* A comm's windows are released at teardown. */
void lb_win_release_all(struct lb_comm *c);
/* winreg.c: window registrations queued in the calling thread's group run at its
 * outermost end. take: hand them over (the count; *ops owns their comm refs); run: run
 * and free them (the first failure); drop: release them unrun. */
struct lb_wop;
int lb_win_group_take(struct lb_wop **ops);
ncclResult_t lb_win_run(struct lb_wop *ops, int n);
void lb_win_drop(struct lb_wop *ops, int n);
struct lb_comm *lb_win_op_comm(const struct lb_wop *ops, int i);
/* The window containing [p, p+bytes) among c's windows with all `flags`, or NULL (mu). */
struct lb_win *lb_win_find(struct lb_comm *c, const void *p, size_t bytes, int flags);
/* 1 if win is a live window of c; then its user pointer/size and, for peer, the address
 * of the peer's window in this process (NULL if unreachable). */
int lb_win_lookup(struct lb_comm *c, ncclWindow_t win, void **user, size_t *size, int peer,
                  void **peer_base);
/* Any live window by handle (no comm needed): 1 with its rank count and, for a valid
 * peer, the peer's window base in this process and its size. */
int lb_win_peer(ncclWindow_t window, int peer, int *nranks, char **base, size_t *size);
/* window.c: numRmaCtx/numRmaSig from the parsed config (before joining the world),
 * waiting out running signal tasks of a halted comm, and freeing at comm_free. */
ncclResult_t lb_rma_setup(struct lb_comm *c, const ncclConfig_t *cfg, const char *opname);
void lb_rma_quiesce(struct lb_comm *c);
void lb_rma_free(struct lb_comm *c);
/* crypto.c: digest of the process's encryption key (0: none). */
uint64_t lb_encryption_hash(void);

/* ---- operations and groups (enqueue.c, launch.c) ------------------------------------- */


/* The kind's row of the LB_COLLECTIVES / LB_P2P tables (a nameless row for a bad kind). */
const struct lb_kind_info *lb_kind(int kind);
const char *lb_kind_name(int kind);
/* Bytes a rank's buffer spans (enum lb_span): nb = count elements, all = nb x nranks. */
size_t lb_span_bytes(int span, size_t nb, size_t all, int is_root);
const char *lb_op_name(int api_op);
int lb_group_depth(void);
/* Record the blocking mode of a comm joining the thread's group; mixing is an error. */
ncclResult_t lb_group_join_mode(int blocking, const char *opname);
ncclResult_t lb_group_defer_init(struct lb_comm *c);
ncclResult_t lb_group_defer_split(struct lb_split *s);
ncclResult_t lb_group_error(ncclResult_t r);

/* ---- the shared-memory world: waits (sync.c) -------------------------------------- */

#define LB_SWEEP_MS 100       /* peer liveness check period while waiting */
#define LB_SLEEP_MS 10        /* futex sleep; bounds abort / failure latency */
#define LB_MSG_HDR 32         /* p2p message header bytes */
#define LB_MSG_MAGIC 0x47534d4e43424cULL
#define LB_REMOTE_ERR (LB_HAS_REMOTE_ERROR ? ncclRemoteError : ncclSystemError)

extern int g_spin_pause, g_spin_yield; /* busy-wait tuning, set at load */
void lbw_backoff(struct lb_comm *c, uint32_t e, int *spins);
ncclResult_t lbw_trouble(struct lb_comm *c, int blocker, int *recheck);
ncclResult_t lbw_gone(struct lb_comm *c, int blocker, const char *what);

/* ---- communicators (config.c, comm.c, core.c) -------------------------------------- */

void lb_apply_config(struct lb_comm *c, const ncclConfig_t *cfg);
ncclResult_t lb_comm_create(const unsigned char *uid, int nranks, int rank, int dev,
                            const ncclConfig_t *cfg, const char *opname, struct lb_comm **out);
void lb_comm_abandon(struct lb_comm *c);
void lb_splits_progress_all(void);
/* Leave the world and kill the handle (the comm's tasks must have stopped). */
void lb_comm_teardown(struct lb_comm *c, enum lbw_rank_state state);
/* child shares parent's memory (NCCL's memory manager with splitShare/shrinkShare). */
void lb_comm_share_memory(struct lb_comm *child, struct lb_comm *parent);
/* Set the async error (first one wins) and stop pending work, without telling the other
 * ranks (a non-blocking group end that failed: NCCL's ncclCommSetAsyncError). */
void lb_comm_set_async(struct lb_comm *c, ncclResult_t r);

/* ---- teardown (teardown.c) ---------------------------------------------------------- */

/* NCCL's "in progress" async state: a non-blocking group end or finalize in flight,
 * a revoke not yet quiescent, or non-blocking splits of this parent pending. */
int lb_comm_in_progress(struct lb_comm *c);
/* What ncclCommFinalize waits for: the comm's work, the CUDA graphs that captured it,
 * and (NCCL >= 2.31.2, after an abortive shrink) every rank's teardown. */
void lb_comm_finalize_sync(struct lb_comm *c);

/* ---- jobs on worker threads: non-blocking group ends and finalize (gjob.c) --------- */

typedef ncclResult_t (*lb_job_fn)(void *arg);
/* Run run(arg) on a worker thread, after PYNCCL_LOOPBACK_NONBLOCKING_DELAY polls, with
 * comms[0..n) in progress until it returns (its error becomes theirs); ncclInProgress. */
ncclResult_t lb_gjob_start(struct lb_comm *const *comms, int n, lb_job_fn run, void *arg);
/* One ncclCommGetAsyncError of c while its job is pending. */
void lb_gjob_polled(struct lb_comm *c);
/* An abort or revoke: hurry c's job (no more delay) and wait until it is done. */
void lb_gjob_abort_wait(struct lb_comm *c);
static inline int lb_gjob_pending(struct lb_comm *c) {
    return __atomic_load_n(&c->gjob, __ATOMIC_ACQUIRE) != NULL;
}

/* ---- groups (group.c) and launching them (launch.c) -------------------------------- */

enum { LBG_OP, LBG_INIT, LBG_SPLIT };

struct lb_gitem {
    int type;
    struct lb_comm *c; /* ref held (OP, INIT) */
    cudaStream_t stream;
    struct lb_op op;
    struct lb_split *split;
};

ncclResult_t lb_group_push(const struct lb_gitem *it);
void lb_group_release(struct lb_gitem *items, int n);
ncclResult_t lb_group_pop(struct lb_gitem **items, int *n, int *blocking, ncclResult_t *err);
ncclResult_t lb_enqueue_task(struct lb_comm *c, const struct lb_gitem *items, const int *idx,
                             int n);
/* Enqueue the OP items of items[0..n), one task per communicator (launch.c). */
ncclResult_t lb_launch_ops(struct lb_gitem *items, int n);
/* A non-blocking group's launch (window registrations, then items' OP items) on a worker
 * (gjob.c); takes items and ops; ncclInProgress. */
ncclResult_t lb_launch_async(struct lb_gitem *items, int n, struct lb_wop *ops, int nops);

/* ---- NCCL_DEBUG=INFO lines (debug.c) ---------------------------------------------- */

#define LB_DBG_INIT 0x1UL
#define LB_DBG_COLL 0x2UL
#define LB_DBG_TUNING 0x40UL
#define LB_DBG_ENV 0x80UL
#define LB_DBG_ALL (~0UL)

int lb_info_on(unsigned long subsys);
int lb_warn_on(void);
void lb_warn(int dev, const char *file, int line, const char *fmt, ...) LBN_PRINTF(4, 5);
void lb_info(unsigned long subsys, int dev, const char *fmt, ...) LBN_PRINTF(3, 4);
void lb_info_comm_ready(const struct lb_comm *c);
/* in_windows: both buffers lie in NCCL_WIN_COLL_SYMMETRIC windows (the caller, above
 * window.c, asks; only when TUNING lines are on). */
void lb_info_coll(struct lb_comm *c, const struct lb_op *op, const char *opname,
                  const void *stream, int in_windows);

#pragma GCC visibility pop

#endif /* PYNCCL_NCCL_LB_INTERNAL_H */
