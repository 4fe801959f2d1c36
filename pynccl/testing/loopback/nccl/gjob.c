/*
 * Non-blocking group ends and finalize in the loopback libnccl, as NCCL's group.cc and
 * init.cc run them.
 *
 * ncclGroupEnd of a non-blocking group (an operation outside a group is a group of
 * one, as in NCCL's ncclEnqueueCheck) sets every communicator of the group to
 * ncclInProgress, returns ncclInProgress and launches the group from a thread of its
 * own (groupLaunchNonBlocking): window registrations first, then one task per
 * communicator on its streams. Until that thread is done, ncclCommGetAsyncError reads
 * ncclInProgress and every call that checks readiness (ncclCommEnsureReady) is refused
 * with ncclInvalidArgument, which NCCL also stores as the comm's async result: the polls
 * read that error until the job ends and stores its own. The operations are not on their
 * streams yet, so a stream synchronize meanwhile returns before they even started. A
 * failed launch becomes every communicator's async error. ncclCommFinalize of a
 * non-blocking communicator likewise waits on a thread of its own.
 *
 * PYNCCL_LOOPBACK_NONBLOCKING_DELAY=<K>, read at the group end (or finalize), holds the
 * job until K ncclCommGetAsyncError calls on its communicators were made meanwhile, so
 * that tests see the window; an abort of one of them ends the wait.
 */
#include "internal.h"
#include "lb_env.h"

#include <stdlib.h>
#include <string.h>

enum { LBJ_GROUP, LBJ_FINALIZE };

struct lb_gjob {
    int kind;
    struct lb_gitem *items; /* group.c's items: OP ones are launched, all released */
    int n;
    struct lb_wop *ops; /* window registrations (winreg.c) */
    int nops;
    struct lb_comm **comms; /* every communicator involved, a ref held on each */
    int ncomms;
    int polls_left; /* g_mu */
    int hurry;      /* g_mu: an abort: no more delay */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;

int lb_gjob_pending(struct lb_comm *c) {
    return __atomic_load_n(&c->gjob, __ATOMIC_ACQUIRE) != NULL;
}

void lb_gjob_polled(struct lb_comm *c) {
    pthread_mutex_lock(&g_mu);
    struct lb_gjob *j = c->gjob;
    if (j && j->polls_left > 0 && --j->polls_left == 0) pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

void lb_gjob_abort_wait(struct lb_comm *c) {
    pthread_mutex_lock(&g_mu);
    if (c->gjob) {
        c->gjob->hurry = 1;
        pthread_cond_broadcast(&g_cv);
    }
    while (c->gjob) pthread_cond_wait(&g_cv, &g_mu);
    pthread_mutex_unlock(&g_mu);
}

static void job_free(struct lb_gjob *j) {
    for (int i = 0; i < j->ncomms; i++) lb_comm_unref(j->comms[i]);
    free(j->comms);
    free(j);
}

static void *job_main(void *arg) {
    struct lb_gjob *j = arg;
    pthread_mutex_lock(&g_mu);
    while (j->polls_left > 0 && !j->hurry) pthread_cond_wait(&g_cv, &g_mu);
    pthread_mutex_unlock(&g_mu);
    if (j->kind == LBJ_FINALIZE) {
        lb_comm_finalize_sync(j->comms[0]);
    } else {
        ncclResult_t r = j->nops ? lb_win_run(j->ops, j->nops) : ncclSuccess;
        if (r == ncclSuccess) r = lb_launch_ops(j->items, j->n);
        lb_group_release(j->items, j->n);
        if (r != ncclSuccess) /* groupLaunch's failure: ncclCommSetAsyncError on each */
            for (int i = 0; i < j->ncomms; i++) lb_comm_set_async(j->comms[i], r);
    }
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < j->ncomms; i++) {
        if (j->comms[i]->gjob != j) continue;
        /* the job's own result replaces what a call refused meanwhile set */
        __atomic_store_n(&j->comms[i]->poison, 0, __ATOMIC_RELEASE);
        __atomic_store_n(&j->comms[i]->gjob, NULL, __ATOMIC_RELEASE);
    }
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    job_free(j);
    return NULL;
}

static ncclResult_t add_comm(struct lb_gjob *j, struct lb_comm *c, int *cap) {
    for (int i = 0; i < j->ncomms; i++)
        if (j->comms[i] == c) return ncclSuccess;
    if (j->ncomms == *cap) {
        int ncap = *cap ? 2 * *cap : 4;
        struct lb_comm **grown = realloc(j->comms, (size_t)ncap * sizeof *grown);
        if (!grown) return lb_err(ncclSystemError, "ncclGroupEnd : out of memory");
        j->comms = grown;
        *cap = ncap;
    }
    lb_comm_ref(c);
    j->comms[j->ncomms++] = c;
    return ncclSuccess;
}

/* Mark the comms in progress and start the thread (or, failing that, run it here). */
static ncclResult_t job_start(struct lb_gjob *j) {
    unsigned long long delay;
    lb_env_uint("PYNCCL_LOOPBACK_NONBLOCKING_DELAY", 0, LB_ENV_MAX_INT, &delay, NULL, 0);
    j->polls_left = (int)delay;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < j->ncomms; i++) __atomic_store_n(&j->comms[i]->gjob, j, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_mu);
    pthread_attr_t attr;
    pthread_t tid;
    int e = pthread_attr_init(&attr);
    if (e == 0) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        e = pthread_create(&tid, &attr, job_main, j);
        pthread_attr_destroy(&attr);
    }
    if (e != 0) { /* no thread: launch synchronously, as a blocking group would */
        j->polls_left = 0;
        job_main(j);
    }
    return LB_HAS_IN_PROGRESS ? ncclInProgress : ncclSuccess;
}

ncclResult_t lb_gjob_group(struct lb_gitem *items, int n, struct lb_wop *ops, int nops) {
    struct lb_gjob *j = calloc(1, sizeof *j);
    int cap = 0;
    ncclResult_t r = j ? ncclSuccess : lb_err(ncclSystemError, "ncclGroupEnd : out of memory");
    if (j) {
        j->kind = LBJ_GROUP;
        j->items = items;
        j->n = n;
        j->ops = ops;
        j->nops = nops;
    }
    for (int i = 0; i < n && r == ncclSuccess; i++)
        if (items[i].type == LBG_OP) r = add_comm(j, items[i].c, &cap);
    for (int i = 0; i < nops && r == ncclSuccess; i++) r = add_comm(j, lb_win_op_comm(ops, i), &cap);
    if (r != ncclSuccess) {
        lb_group_release(items, n);
        lb_win_drop(ops, nops);
        if (j) job_free(j);
        return r;
    }
    return job_start(j);
}

ncclResult_t lb_gjob_finalize(struct lb_comm *c) {
    struct lb_gjob *j = calloc(1, sizeof *j);
    int cap = 0;
    ncclResult_t r = j ? add_comm(j, c, &cap)
                       : lb_err(ncclSystemError, "ncclCommFinalize : out of memory");
    if (r != ncclSuccess) {
        if (j) job_free(j);
        return r;
    }
    j->kind = LBJ_FINALIZE;
    return job_start(j);
}
