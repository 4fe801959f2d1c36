/*
 * Waiting in the loopback's shared-memory worlds: the futex, spinning and backing off,
 * broken worlds and the sweep for dead peers (see world.c for the whole transport).
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



/* ---- futex and waiting ------------------------------------------------------------ */

static void futex_wait(uint32_t *addr, uint32_t val, long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake_all(uint32_t *addr) {
    syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

int g_spin_pause = -1, g_spin_yield = -1;

static void spin_params(void) {
    if (__atomic_load_n(&g_spin_pause, __ATOMIC_RELAXED) >= 0) return;
    /* With few cores, spinning (or sched_yield, which only looks at this core's run
     * queue) steals the core a peer needs: sleep on the futex at once. */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned long long pause, yield;
    lb_env_uint("PYNCCL_LOOPBACK_SPIN", ncpu >= 8 ? 2000 : 0, LB_ENV_MAX_INT, &pause, NULL, 0);
    lb_env_uint("PYNCCL_LOOPBACK_YIELDS", 0, LB_ENV_MAX_INT, &yield, NULL, 0);
    __atomic_store_n(&g_spin_yield, (int)yield, __ATOMIC_RELAXED);
    __atomic_store_n(&g_spin_pause, (int)pause, __ATOMIC_RELEASE);
}

void lbw_notify(struct lb_comm *c) {
    struct lbw_hdr *w = c->w;
    __atomic_add_fetch(&w->epoch, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&w->waiters, __ATOMIC_SEQ_CST)) futex_wake_all(&w->epoch);
}

/* One step of backing off while waiting for the epoch to move past e. */
void lbw_backoff(struct lb_comm *c, uint32_t e, int *spins) {
    int s = (*spins)++;
    if (s < g_spin_pause) {
        cpu_relax();
        return;
    }
    if (s < g_spin_pause + g_spin_yield) {
        sched_yield();
        return;
    }
    struct lbw_hdr *w = c->w;
    __atomic_add_fetch(&w->waiters, 1, __ATOMIC_SEQ_CST);
    futex_wait(&w->epoch, e, LB_SLEEP_MS);
    __atomic_sub_fetch(&w->waiters, 1, __ATOMIC_SEQ_CST);
}

/* ---- broken worlds and peer failure -------------------------------------------- */

void lbw_break(struct lb_comm *c, ncclResult_t code, int set_local, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (set_local) lb_set_error("%s", msg);
    struct lbw_hdr *w = c->w;
    if (!w) return;
    uint32_t zero = 0;
    if (__atomic_compare_exchange_n(&w->broken, &zero, (uint32_t)code, 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST)) {
        w->broken_rank = c->rank;
        snprintf(w->broken_msg, sizeof w->broken_msg, "%s", msg);
        __atomic_store_n(&w->broken_msg_ready, 1, __ATOMIC_RELEASE);
    }
    lbw_notify(c);
}

ncclResult_t lbw_broken(struct lb_comm *c) {
    struct lbw_hdr *w = c->w;
    if (!w) return ncclSuccess;
    uint32_t b = __atomic_load_n(&w->broken, __ATOMIC_ACQUIRE);
    if (!b) return ncclSuccess;
    if (__atomic_load_n(&w->broken_msg_ready, __ATOMIC_ACQUIRE))
        lb_set_error("rank %d: %s", c->rank, w->broken_msg);
    else
        lb_set_error("rank %d: communicator broken by rank %d", c->rank, w->broken_rank);
    return (ncclResult_t)b;
}

/* A process is gone when kill() says so or it is a zombie nobody reaped yet. */
static int pid_alive(pid_t pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno != ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 1;
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    if (p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X')) return 0;
    return 1;
}

int lbw_pid_alive(pid_t pid) { return pid_alive(pid); }

ncclResult_t lbw_peer_sweep(struct lb_comm *c, uint64_t *last_ns) {
    uint64_t now = lb_now_ns();
    if (now - *last_ns < (uint64_t)LB_SWEEP_MS * 1000000ULL) return ncclSuccess;
    *last_ns = now;
    for (int s = 0; s < c->nranks; s++) {
        if (s == c->rank) continue;
        pid_t pid = __atomic_load_n(&c->ranks[s].pid, __ATOMIC_ACQUIRE);
        uint32_t st = __atomic_load_n(&c->ranks[s].state, __ATOMIC_ACQUIRE);
        if (!pid || pid == c->pid || st != LBR_JOINED) continue;
        if (!pid_alive(pid)) {
            lbw_break(c, LB_REMOTE_ERR, 1, "rank %d (pid %d) exited without destroying its communicator",
                      s, (int)pid);
            return LB_REMOTE_ERR;
        }
    }
    return ncclSuccess;
}

/* Checks made on every round of a wait. blocker: a rank being waited for, or -1.
 * Returns ncclSuccess to keep waiting; *recheck = 1 when the blocker has gone, in which
 * case the caller re-evaluates its condition once (the peer may have finished first)
 * and then fails with the returned error. */
ncclResult_t lbw_trouble(struct lb_comm *c, int blocker, int *recheck) {
    *recheck = 0;
    if (__atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE) || __atomic_load_n(&c->cancel, __ATOMIC_ACQUIRE))
        return LB_ABORTED; /* aborted, or revoked / shrunk with NCCL_SHRINK_ABORT until quiet */
    ncclResult_t r = lbw_broken(c);
    if (r != ncclSuccess) return r;
    if (blocker >= 0 && blocker != c->rank) {
        uint32_t st = __atomic_load_n(&c->ranks[blocker].state, __ATOMIC_ACQUIRE);
        if (st == LBR_LEFT || st == LBR_FAILED) {
            *recheck = 1;
            return LB_REMOTE_ERR;
        }
    }
    return lbw_peer_sweep(c, &c->last_sweep_ns);
}

ncclResult_t lbw_gone(struct lb_comm *c, int blocker, const char *what) {
    uint32_t st = __atomic_load_n(&c->ranks[blocker].state, __ATOMIC_ACQUIRE);
    lbw_break(c, LB_REMOTE_ERR, 1, "rank %d %s its communicator while rank %d waited for it in %s",
              blocker, st == LBR_LEFT ? "destroyed" : "aborted", c->rank, what);
    return LB_REMOTE_ERR;
}


__attribute__((constructor)) static void lb_transport_init(void) { spin_params(); }
