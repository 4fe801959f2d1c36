/*
 * Who a communicator still waits for during init: the process's comms still joining their
 * world (a list), the query pynccl asks while ncclCommInitRank blocks
 * (pynccl_lb_init_missing), and NCCL-shaped WARN lines naming the missing ranks every
 * PYNCCL_INIT_REPORT seconds (default 30, 0: never) and at the init timeout, written when
 * NCCL_DEBUG is WARN or INFO.
 */
#include "internal.h"
#include "lb_env.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct lb_comm *g_joining; /* linked through joining_next (g_mu) */

void lb_joining_add(struct lb_comm *c) {
    pthread_mutex_lock(&g_mu);
    c->joining_next = g_joining;
    g_joining = c;
    pthread_mutex_unlock(&g_mu);
}

/* Idempotent: called when init ends, whichever way, and before the world is unmapped. */
void lb_joining_remove(struct lb_comm *c) {
    pthread_mutex_lock(&g_mu);
    for (struct lb_comm **p = &g_joining; *p; p = &(*p)->joining_next) {
        if (*p == c) {
            *p = c->joining_next;
            break;
        }
    }
    c->joining_next = NULL;
    pthread_mutex_unlock(&g_mu);
}

void lb_init_report_setup(struct lb_comm *c) {
    double every;
    lb_env_seconds("PYNCCL_INIT_REPORT", 30, &every, NULL, 0); /* checked at init */
    c->init_start_ns = lb_now_ns();
    c->init_report_ns = every > 0 ? (uint64_t)(every * 1e9) : 0;
    c->init_next_report_ns = c->init_start_ns + c->init_report_ns;
}

/* Ranks whose state is (or is not, with `want` 0) LBR_EMPTY, as "2, 5-7"; their count. */
static int ranks_text(const struct lb_comm *c, int want, char *out, size_t n) {
    size_t used = 0;
    int count = 0;
    out[0] = '\0';
    for (int s = 0; s < c->nranks; s++) {
        int empty = __atomic_load_n(&c->ranks[s].state, __ATOMIC_ACQUIRE) == LBR_EMPTY;
        if (empty != want) continue;
        int e = s;
        while (e + 1 < c->nranks &&
               (__atomic_load_n(&c->ranks[e + 1].state, __ATOMIC_ACQUIRE) == LBR_EMPTY) == want)
            e++;
        int k = e == s ? snprintf(out + used, n - used, "%s%d", count ? ", " : "", s)
                       : snprintf(out + used, n - used, "%s%d-%d", count ? ", " : "", s, e);
        if (k > 0 && used + (size_t)k < n) used += (size_t)k;
        count += e - s + 1;
        s = e;
    }
    if (!count) snprintf(out, n, "none");
    return count;
}

/* One WARN line if the interval has passed (or at the timeout): who has not joined yet. */
void lb_init_report(struct lb_comm *c, const char *opname, int timed_out) {
    uint64_t now = lb_now_ns();
    if (!timed_out && (!c->init_report_ns || now < c->init_next_report_ns)) return;
    c->init_next_report_ns = now + c->init_report_ns;
    if (!lb_warn_on() || !c->ranks) return;
    char missing[512], arrived[512];
    int nmiss = ranks_text(c, 1, missing, sizeof missing);
    ranks_text(c, 0, arrived, sizeof arrived);
    lb_warn(c->dev, __FILE__, __LINE__,
            "%s : rank %d has waited %.0f s for %s %s of %d to join%s (arrived: %s; "
            "PYNCCL_INIT_REPORT)",
            opname, c->rank, (double)(now - c->init_start_ns) / 1e9,
            nmiss == 1 ? "rank" : "ranks", missing, c->nranks, timed_out ? ", giving up" : "",
            arrived);
}

/* pynccl's question while its ncclCommInitRank blocks: which ranks of the world named by
 * `uid` (NCCL_UNIQUE_ID_BYTES) have not joined? Writes up to `cap` of them in order into
 * `missing` and the world's size into *nranks; returns how many are missing, or -1 when no
 * communicator of this process is joining that world. */
LB_EXPORT int pynccl_lb_init_missing(const unsigned char *uid, int *missing, int cap,
                                     int *nranks) {
    int count = -1;
    if (!uid) return -1;
    pthread_mutex_lock(&g_mu);
    for (struct lb_comm *c = g_joining; c; c = c->joining_next) {
        if (memcmp(c->uid, uid, NCCL_UNIQUE_ID_BYTES) != 0 || !c->ranks) continue;
        count = 0;
        for (int s = 0; s < c->nranks; s++) {
            if (__atomic_load_n(&c->ranks[s].state, __ATOMIC_ACQUIRE) != LBR_EMPTY) continue;
            if (missing && count < cap) missing[count] = s;
            count++;
        }
        if (nranks) *nranks = c->nranks;
        break;
    }
    pthread_mutex_unlock(&g_mu);
    return count;
}
