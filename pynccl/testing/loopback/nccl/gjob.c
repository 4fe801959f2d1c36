/*
 * Jobs on worker threads, for what NCCL runs on threads of its own: a non-blocking
 * group's launch (group.cc: groupLaunchNonBlocking; launch.c, winreg.c) and a
 * non-blocking communicator's finalize (init.cc; teardown.c).
 *
 * Starting a job marks every communicator involved as in progress (lb_comm.gjob): until
 * the job is done, ncclCommGetAsyncError reads ncclInProgress and every call that checks
 * readiness (ncclCommEnsureReady) is refused with ncclInvalidArgument, which NCCL also
 * stores as the comm's async result: the polls read that error until the job ends and
 * stores its own (ncclCommSetAsyncError). A job that fails sets every communicator's
 * async error.
 *
 * PYNCCL_LOOPBACK_NONBLOCKING_DELAY=<K>, read as a job starts, holds it until K
 * ncclCommGetAsyncError calls on its communicators were made meanwhile, so that tests
 * see the window; an abort of one of them ends the wait.
 */
#include "internal.h"
#include "lb_env.h"

#include <stdlib.h>
#include <string.h>

struct lb_gjob {
    lb_job_fn run;
    void *arg;
    struct lb_comm **comms; /* every communicator involved, a ref held on each */
    int ncomms;
    int polls_left; /* g_mu */
    int hurry;      /* g_mu: an abort: no more delay */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;

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
    ncclResult_t r = j->run(j->arg);
    if (r != ncclSuccess) /* groupLaunch's failure: ncclCommSetAsyncError on each */
        for (int i = 0; i < j->ncomms; i++) lb_comm_set_async(j->comms[i], r);
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

ncclResult_t lb_gjob_start(struct lb_comm *const *comms, int n, lb_job_fn run, void *arg) {
    struct lb_gjob *j = calloc(1, sizeof *j);
    if (j) j->comms = calloc((size_t)(n ? n : 1), sizeof *j->comms);
    if (!j || !j->comms) { /* no memory for a job: run it here, as a blocking group would */
        free(j);
        return run(arg);
    }
    j->run = run;
    j->arg = arg;
    for (int i = 0; i < n; i++) {
        int seen = 0;
        for (int k = 0; k < j->ncomms && !seen; k++) seen = j->comms[k] == comms[i];
        if (seen) continue;
        lb_comm_ref(comms[i]);
        j->comms[j->ncomms++] = comms[i];
    }
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
    if (e != 0) { /* no thread: run it here */
        j->polls_left = 0;
        job_main(j);
    }
    return LB_HAS_IN_PROGRESS ? ncclInProgress : ncclSuccess;
}
