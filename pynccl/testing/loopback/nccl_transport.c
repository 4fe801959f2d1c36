/*
 * The shared-memory transport of the loopback libnccl.
 *
 * Each communicator's ranks share one shared-memory segment (the "world"): an unnamed
 * memfd, so that nothing is ever left in /dev/shm. The rendezvous is an abstract unix
 * socket named from the unique id (@pynccl-lb-<hex>), a name that lives in the kernel
 * and dies with its process: the rank that binds it first is the creator; it makes the
 * segment, then listens. The others connect, learn the creator's pid (SO_PEERCRED) and
 * open its memfd through /proc/<pid>/fd. The creator closes both once every rank has
 * joined (or when it leaves), so a job killed at any point of init leaves nothing.
 * Threads of one process join like separate processes do: a single code path.
 *
 * Layout: header | per-rank records | p2p ring controls (nranks^2) | collective slots
 * (2 buffers x nranks x slot_bytes) | p2p ring data (nranks^2 x ring_bytes). Sizes are
 * fixed at creation (PYNCCL_LOOPBACK_CHUNK_BYTES, PYNCCL_LOOPBACK_RING_BYTES), not
 * proportional to the data: collectives are chunked and pipelined through the slots.
 *
 * Synchronisation: every rank publishes a monotonically increasing phase counter
 * (cstep); a wait is "until these ranks' counters reach X". Progress bumps one futex
 * word per world (epoch); waiters spin briefly, then yield, then sleep on the futex
 * with a short timeout so that they notice aborts, broken worlds and dead peers
 * (kill(pid, 0) and /proc/<pid>/stat, every LB_SWEEP_MS) within a bounded time.
 *
 * Every collective starts with a descriptor barrier: each rank posts (kind, count, type,
 * op, root, buffer addresses, whether it can read every peer's memory); all compare,
 * so mismatched collectives fail with ncclInvalidUsage instead of hanging. Then:
 *
 * Direct mode, when all ranks are threads of one process: each rank pulls what it
 * needs straight from the peers' buffers; a final barrier keeps the sources valid
 * until all have pulled. One copy of the data instead of two, and no chunking.
 *
 * Staged mode otherwise (R ranks, chunk g uses slot buffer g%2; phases 3g+1..3g+3):
 *   AllReduce/Reduce: each rank copies the slices of its chunk that others reduce into
 *     its slot, reduces its own slice in rank order from every slot (its own data read
 *     in place) and publishes the result; everyone copies the other slices back.
 *   Broadcast/Scatter: the root fills its slot; the others copy out.
 *   AllGather/Gather/AlltoAll: everyone fills its slot; readers copy out.
 *   ReduceScatter: everyone fills its slot with the others' segments; each rank reduces
 *     its own segment.
 * Before filling buffer g%2 a rank waits until everyone finished chunk g-2.
 *
 * P2P: one ring per ordered pair, a 32-byte message header (size, type) then the
 * payload padded to 32 bytes. Ops of one group progress together, so pairs of sends
 * that would deadlock one after the other complete.
 */
#include "nccl_lb_internal.h"
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

#define LB_SWEEP_MS 100       /* peer liveness check period while waiting */
#define LB_SLEEP_MS 10        /* futex sleep; bounds abort / failure latency */
#define LB_MSG_HDR 32         /* p2p message header bytes */
#define LB_MSG_MAGIC 0x47534d4e43424cULL
#define LB_REMOTE_ERR (LB_HAS_REMOTE_ERROR ? ncclRemoteError : ncclSystemError)


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

static int g_spin_pause = -1, g_spin_yield = -1;

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
static void lbw_backoff(struct lb_comm *c, uint32_t e, int *spins) {
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
static ncclResult_t lbw_trouble(struct lb_comm *c, int blocker, int *recheck) {
    *recheck = 0;
    if (__atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE) || __atomic_load_n(&c->stopped, __ATOMIC_ACQUIRE))
        return LB_ABORTED; /* aborted, revoked, or shrunk with NCCL_SHRINK_ABORT */
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

static ncclResult_t lbw_gone(struct lb_comm *c, int blocker, const char *what) {
    uint32_t st = __atomic_load_n(&c->ranks[blocker].state, __ATOMIC_ACQUIRE);
    lbw_break(c, LB_REMOTE_ERR, 1, "rank %d %s its communicator while rank %d waited for it in %s",
              blocker, st == LBR_LEFT ? "destroyed" : "aborted", c->rank, what);
    return LB_REMOTE_ERR;
}

/* ---- world creation and joining ------------------------------------------------- */

static void shm_name_of(const unsigned char *uid, char *out, size_t n) {
    /* bytes 0..7 (random magic) and 64..79 (random tag) of our unique id layout */
    static const char hx[] = "0123456789abcdef";
    char hex[49];
    int k = 0;
    for (int i = 0; i < 8; i++) {
        hex[k++] = hx[uid[i] >> 4];
        hex[k++] = hx[uid[i] & 15];
    }
    for (int i = 64; i < 80; i++) {
        hex[k++] = hx[uid[i] >> 4];
        hex[k++] = hx[uid[i] & 15];
    }
    hex[k] = 0;
    snprintf(out, n, "/" LBW_SHM_PREFIX "%s", hex);
}

static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static void layout(struct lbw_hdr *h, int nranks, int nctx, int nsig) {
    size_t R = (size_t)nranks;
    unsigned long long slot_env, ring_env;
    lb_env_uint("PYNCCL_LOOPBACK_CHUNK_BYTES", 0, LB_ENV_MAX_INT, &slot_env, NULL, 0);
    lb_env_uint("PYNCCL_LOOPBACK_RING_BYTES", 0, LB_ENV_MAX_INT, &ring_env, NULL, 0);
    long long slot = (long long)slot_env, ring = (long long)ring_env;
    if (slot <= 0) { /* big enough to amortise the barriers, small enough for the caches */
        slot = (long long)((4u << 20) / R);
        if (slot > (1 << 20)) slot = 1 << 20;
        if (slot < (256 << 10)) slot = 256 << 10;
    }
    if (ring <= 0) {
        ring = (long long)((4u << 20) / (R * R));
        if (ring > (256 << 10)) ring = 256 << 10;
        if (ring < (16 << 10)) ring = 16 << 10;
    }
    /* A slot holds one element per rank at least (ReduceScatter, AlltoAll, Scatter). */
    if ((size_t)slot < R * 8) slot = (long long)(R * 8);
    slot = (long long)align_up((size_t)slot, LB_CACHELINE);
    if (ring < 2 * LB_MSG_HDR) ring = 2 * LB_MSG_HDR;
    ring = (long long)align_up((size_t)ring, LB_MSG_HDR);
    h->nranks = nranks;
    h->slot_bytes = (uint64_t)slot;
    h->ring_bytes = (uint64_t)ring;
    size_t off = align_up(sizeof(struct lbw_hdr), 4096);
    h->ranks_off = off;
    off = align_up(off + R * sizeof(struct lbw_rank), 4096);
    h->rings_off = off;
    off = align_up(off + R * R * sizeof(struct lbw_ring), 4096);
    h->slots_off = off;
    off = align_up(off + 2 * R * (size_t)slot, 4096);
    h->ringdata_off = off;
    off = align_up(off + R * R * (size_t)ring, 4096);
    h->sig_off = off; /* one-sided signal counts (nccl_signal.c) */
    h->rma_nctx = nctx;
    h->rma_nsig = nsig;
    off = align_up(off + R * R * (size_t)nctx * (size_t)nsig * sizeof(uint64_t), 4096);
    h->size = off;
}

static void map_pointers(struct lb_comm *c) {
    struct lbw_hdr *w = c->w;
    c->ranks = (struct lbw_rank *)((char *)w + w->ranks_off);
    c->rings = (struct lbw_ring *)((char *)w + w->rings_off);
    c->slots = (char *)w + w->slots_off;
    c->ringdata = (char *)w + w->ringdata_off;
    c->sig = (uint64_t *)((char *)w + w->sig_off);
    c->slot_bytes = w->slot_bytes;
    c->ring_bytes = w->ring_bytes;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The rendezvous socket of a world: "\0pynccl-lb-<hex>" in the abstract namespace, or, with
 * PYNCCL_LOOPBACK_RENDEZVOUS_DIR, the file <dir>/pynccl-lb-<hex>. Abstract names belong to
 * a network namespace: ranks in different ones (the multi-host test's "hosts") meet in a
 * directory they share; a creator killed before everyone joined leaves that file there. */
static socklen_t rv_addr(const struct lb_comm *c, struct sockaddr_un *sa) {
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    const char *dir = NULL;
    lb_env_dir("PYNCCL_LOOPBACK_RENDEZVOUS_DIR", &dir, NULL, 0); /* checked at init */
    if (dir) { /* LB_ENV_MAX_DIR keeps it inside sun_path */
        int n = snprintf(sa->sun_path, sizeof sa->sun_path, "%s%s", dir, c->shm_name);
        return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)n + 1);
    }
    size_t n = strlen(c->shm_name + 1); /* skip the leading '/' */
    memcpy(sa->sun_path + 1, c->shm_name + 1, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* Close the creator's rendezvous socket and memfd (the world stays mapped). */
void lbw_rendezvous_close(struct lb_comm *c) {
    if (c->rv_fd >= 0) {
        struct sockaddr_un sa;
        rv_addr(c, &sa);
        if (sa.sun_path[0]) unlink(sa.sun_path); /* a file socket: its name goes too */
        close(c->rv_fd);
    }
    if (c->seg_fd >= 0) close(c->seg_fd);
    c->rv_fd = c->seg_fd = -1;
}

/* The creator's memfd for this world, opened through /proc/<pid>/fd; -1 if not there. */
static int open_creator_memfd(const struct lb_comm *c, pid_t pid) {
    char dir[64], want[160], path[96], got[160];
    snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
    snprintf(want, sizeof want, "/memfd:%s (deleted)", c->shm_name + 1);
    DIR *d = opendir(dir);
    if (!d) return -1;
    int fd = -1;
    struct dirent *de;
    while (fd < 0 && (de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        ssize_t n = readlink(path, got, sizeof got - 1);
        if (n <= 0) continue;
        got[n] = 0;
        if (strcmp(got, want) == 0) fd = open(path, O_RDWR | O_CLOEXEC);
    }
    closedir(d);
    return fd;
}

/* Create the world as its creator: size and fill a fresh memfd, map it. */
static ncclResult_t create_world(struct lb_comm *c, const char *opname, int *fd_out,
                                 struct lbw_hdr **w_out, size_t *size_out) {
    int fd = memfd_create(c->shm_name + 1, MFD_CLOEXEC);
    if (fd < 0)
        return lb_err(ncclSystemError, "%s : memfd_create(%s) failed: %s", opname,
                      c->shm_name + 1, strerror(errno));
    struct lbw_hdr h;
    memset(&h, 0, sizeof h);
    layout(&h, c->nranks, c->rma_ctx, c->rma_sig);
    size_t size = h.size;
    /* Reserve the pages now: exhausted shared memory then fails init cleanly instead of
     * raising SIGBUS in the middle of a collective. */
    int e = ftruncate(fd, (off_t)size) == 0 ? posix_fallocate(fd, 0, (off_t)size) : errno;
    if (e != 0) {
        close(fd);
        return lb_err(ncclSystemError,
                      "%s : cannot reserve %zu bytes of shared memory for %s: %s (is the "
                      "memory limit reached?)",
                      opname, size, c->shm_name + 1, strerror(e));
    }
    struct lbw_hdr *w = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (w == MAP_FAILED) {
        e = errno;
        close(fd);
        return lb_err(ncclSystemError, "%s : mmap of %zu bytes failed: %s", opname, size,
                      strerror(e));
    }
    h.layout = LBW_LAYOUT;
    h.creator_pid = (int32_t)c->pid;
    h.lib_version = LB_NCCL_VERSION_CODE;
    memcpy(w, &h, offsetof(struct lbw_hdr, joined));
    __atomic_store_n(&w->magic, LBW_MAGIC, __ATOMIC_RELEASE);
    *fd_out = fd;
    *w_out = w;
    *size_out = size;
    return ncclSuccess;
}

ncclResult_t lbw_join(struct lb_comm *c, const char *opname) {
    shm_name_of(c->uid, c->shm_name, sizeof c->shm_name);
    struct sockaddr_un sa;
    socklen_t salen = rv_addr(c, &sa);
    struct lbw_hdr *w = NULL;
    size_t size = 0;
    int fd = -1;
    pid_t creator = 0; /* reached, but its memfd not (yet) found in /proc/<pid>/fd */
    uint64_t deadline = lb_now_ns() + 30ULL * 1000000000ULL;
    for (;;) {
        int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (s < 0)
            return lb_err(ncclSystemError, "%s : socket(AF_UNIX) failed: %s", opname,
                          strerror(errno));
        if (bind(s, (struct sockaddr *)&sa, salen) == 0) { /* first: the creator */
            ncclResult_t r = create_world(c, opname, &fd, &w, &size);
            if (r == ncclSuccess && listen(s, SOMAXCONN) != 0) {
                r = lb_err(ncclSystemError, "%s : listen(@%s) failed: %s", opname,
                           c->shm_name + 1, strerror(errno));
                munmap(w, size);
                close(fd);
            }
            if (r != ncclSuccess) {
                close(s);
                return r;
            }
            c->rv_fd = s;
            c->seg_fd = fd;
            break;
        }
        int e = errno;
        if (e == EADDRINUSE && connect(s, (struct sockaddr *)&sa, salen) == 0) {
            struct ucred cred;
            socklen_t cl = sizeof cred;
            if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0) {
                creator = cred.pid;
                fd = open_creator_memfd(c, cred.pid);
            }
        } else if (e != EADDRINUSE) {
            close(s);
            return lb_err(ncclSystemError, "%s : bind(@%s) failed: %s", opname, c->shm_name + 1,
                          strerror(e));
        }
        close(s);
        if (fd >= 0) {
            struct stat st;
            if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(struct lbw_hdr)) {
                close(fd);
                return lb_err(ncclSystemError, "%s : the segment of %s is unusable", opname,
                              c->shm_name + 1);
            }
            size = (size_t)st.st_size;
            w = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (w == MAP_FAILED) {
                e = errno;
                close(fd);
                return lb_err(ncclSystemError, "%s : mmap of %zu bytes failed: %s", opname, size,
                              strerror(e));
            }
            close(fd);
            fd = -1;
            break;
        }
        /* the creator has bound but is not listening yet (or just died): try again */
        if (lb_now_ns() > deadline && creator)
            return lb_err(ncclSystemError,
                          "%s : the creator of %s (pid %d) listens, but its segment cannot be "
                          "opened through /proc/%d/fd (is /proc mounted with hidepid?)",
                          opname, c->shm_name + 1, (int)creator, (int)creator);
        if (lb_now_ns() > deadline)
            return lb_err(ncclSystemError, "%s : could not reach the creator of %s", opname,
                          c->shm_name + 1);
        sleep_ms(1);
    }
    c->w = w;
    c->wsize = size;
    if (__atomic_load_n(&w->magic, __ATOMIC_ACQUIRE) != LBW_MAGIC || w->layout != LBW_LAYOUT ||
        w->size != size) {
        lbw_leave(c, LBR_FAILED);
        return lb_err(ncclInternalError, "%s : %s has an unexpected layout", opname, c->shm_name);
    }
    if (w->nranks != c->nranks) {
        int theirs = w->nranks;
        lbw_break(c, ncclInvalidUsage, 1,
                  "%s : rank %d called init with nranks=%d, but the communicator of this unique "
                  "id was created with nranks=%d",
                  opname, c->rank, c->nranks, theirs);
        c->w = NULL;
        munmap(w, size);
        lbw_rendezvous_close(c);
        return ncclInvalidUsage;
    }
    if (w->rma_nctx != c->rma_ctx || w->rma_nsig != c->rma_sig) {
        int tc = w->rma_nctx, ts = w->rma_nsig;
        lbw_break(c, ncclInvalidUsage, 1,
                  "%s : rank %d has numRmaCtx=%d numRmaSig=%d, but the communicator of this "
                  "unique id was created with numRmaCtx=%d numRmaSig=%d",
                  opname, c->rank, c->rma_ctx, c->rma_sig, tc, ts);
        c->w = NULL;
        munmap(w, size);
        return ncclInvalidUsage;
    }
    map_pointers(c);
    struct lbw_rank *me = &c->ranks[c->rank];
    int32_t expected = 0;
    if (!__atomic_compare_exchange_n(&me->pid, &expected, (int32_t)c->pid, 0, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST)) {
        c->w = NULL;
        munmap(w, size);
        lbw_rendezvous_close(c);
        return lb_err(ncclInvalidUsage,
                      "%s : rank %d of this unique id was already taken (by pid %d); each rank "
                      "must join once",
                      opname, c->rank, (int)expected);
    }
    me->device = c->dev;
    me->phys = pynccl_lb_device_physical(c->dev);
    me->enc_hash = lb_encryption_hash();
    __atomic_store_n(&me->state, LBR_JOINED, __ATOMIC_RELEASE);
    uint32_t n = __atomic_add_fetch(&w->joined, 1, __ATOMIC_SEQ_CST);
    if ((int)n == c->nranks) lbw_rendezvous_close(c); /* a 1-rank world, or the last */
    lbw_notify(c);
    return ncclSuccess;
}

/* Like the executor's waits, with a sweep clock of its own: these waits run beside the
 * executor (window rounds on the caller's thread, signal waits on their streams). */
ncclResult_t lbw_wait_for(struct lb_comm *c, lbw_ready_fn ready, void *arg, const char *what) {
    int spins = 0;
    uint64_t last_sweep = lb_now_ns();
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        int blocker = -1;
        if (ready(c, arg, &blocker)) return ncclSuccess;
        if (__atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE)) return LB_ABORTED;
        ncclResult_t r = lbw_broken(c);
        if (r != ncclSuccess) return r;
        if (blocker >= 0 && blocker != c->rank) {
            uint32_t st = __atomic_load_n(&c->ranks[blocker].state, __ATOMIC_ACQUIRE);
            if (st == LBR_LEFT || st == LBR_FAILED) {
                if (ready(c, arg, &blocker)) return ncclSuccess;
                return lbw_gone(c, blocker, what);
            }
        }
        if ((r = lbw_peer_sweep(c, &last_sweep)) != ncclSuccess) return r;
        lbw_backoff(c, e, &spins);
    }
}

int lbw_all_joined(struct lb_comm *c) {
    int all = (int)__atomic_load_n(&c->w->joined, __ATOMIC_ACQUIRE) >= c->nranks;
    if (all && c->rv_fd >= 0) lbw_rendezvous_close(c); /* everyone has it mapped */
    return all;
}

/* Once everyone joined: the checks NCCL makes after its bootstrap all-gather. */
static ncclResult_t joined_checks(struct lb_comm *c, const char *opname) {
    for (int a = 1; a < c->nranks; a++) {
        if (c->ranks[a].enc_hash != c->ranks[0].enc_hash)
            return lb_err(ncclSystemError,
                          "%s : rank %d and rank %d use different encryption settings "
                          "(ncclSetEncryption): the connection handshake fails",
                          opname, 0, a);
    }
    if (!c->strict) return ncclSuccess;
    for (int a = 0; a < c->nranks; a++) {
        for (int b = a + 1; b < c->nranks; b++) {
            /* NCCL compares the busId: one device is one GPU whatever the process and
             * whatever CUDA_VISIBLE_DEVICES renumbered it to */
            if (c->ranks[a].phys == c->ranks[b].phys) {
                return lb_err(ncclInvalidUsage,
                              "%s : Duplicate GPU detected : rank %d and rank %d both on loopback "
                              "physical device %d (processes %d and %d; call cudaSetDevice with a "
                              "distinct device per rank, or set PYNCCL_LOOPBACK_STRICT=0)",
                              opname, a, b, c->ranks[a].phys, (int)c->ranks[a].pid,
                              (int)c->ranks[b].pid);
            }
        }
    }
    return ncclSuccess;
}

static int first_missing(struct lb_comm *c) {
    for (int s = 0; s < c->nranks; s++)
        if (__atomic_load_n(&c->ranks[s].state, __ATOMIC_ACQUIRE) == LBR_EMPTY) return s;
    return -1;
}

ncclResult_t lbw_check_joined(struct lb_comm *c, const char *opname) {
    if (lbw_all_joined(c)) return joined_checks(c, opname);
    int recheck;
    ncclResult_t r = lbw_trouble(c, -1, &recheck);
    if (r == LB_ABORTED) return lb_err(LB_REMOTE_ERR, "%s : aborted during init", opname);
    if (r != ncclSuccess) return r;
    if (c->init_deadline_ns && lb_now_ns() > c->init_deadline_ns) {
        int miss = first_missing(c);
        lbw_break(c, LB_REMOTE_ERR, 1,
                  "%s : timed out waiting for rank %d of %d to join (PYNCCL_LOOPBACK_INIT_TIMEOUT)",
                  opname, miss, c->nranks);
        return LB_REMOTE_ERR;
    }
    return ncclInProgress;
}

ncclResult_t lbw_wait_joined(struct lb_comm *c, const char *opname) {
    int spins = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        ncclResult_t r = lbw_check_joined(c, opname);
        if (r != ncclInProgress) return r;
        lbw_backoff(c, e, &spins);
    }
}

void lbw_leave(struct lb_comm *c, enum lbw_rank_state state) {
    struct lbw_hdr *w = c->w;
    if (!w) return;
    if (c->ranks) {
        __atomic_store_n(&c->ranks[c->rank].state, (uint32_t)state, __ATOMIC_RELEASE);
        lbw_notify(c);
    }
    lbw_rendezvous_close(c);
    munmap(w, c->wsize);
    c->w = NULL;
    c->ranks = NULL;
}

ncclResult_t lbw_wait_until(struct lb_comm *c, int (*ready)(struct lb_comm *, void *), void *arg,
                            const char *what) {
    int spins = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        if (ready(c, arg)) return ncclSuccess;
        int recheck;
        ncclResult_t r = lbw_trouble(c, -1, &recheck);
        if (r == LB_ABORTED) return lb_err(LB_REMOTE_ERR, "%s : communicator aborted or revoked", what);
        if (r != ncclSuccess) return r;
        lbw_backoff(c, e, &spins);
    }
}

/* ---- split control ------------------------------------------------------------------ */

ncclResult_t lbw_split_post(struct lb_comm *c, uint64_t seq, int color, int key) {
    /* Everyone must have read split seq-1 before this rank overwrites its post. */
    int spins = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        int blocker = -1;
        for (int s = 0; s < c->nranks; s++) {
            if (__atomic_load_n(&c->ranks[s].split_read, __ATOMIC_ACQUIRE) + 1 < seq) {
                blocker = s;
                break;
            }
        }
        if (blocker < 0) break;
        int recheck;
        ncclResult_t r = lbw_trouble(c, blocker, &recheck);
        if (recheck) return lbw_gone(c, blocker, "ncclCommSplit");
        if (r == LB_ABORTED) return lb_err(LB_REMOTE_ERR, "ncclCommSplit : comm aborted");
        if (r != ncclSuccess) return r;
        lbw_backoff(c, e, &spins);
    }
    struct lbw_rank *me = &c->ranks[c->rank];
    me->split_color = color;
    me->split_key = key;
    __atomic_store_n(&me->split_post, seq, __ATOMIC_RELEASE);
    lbw_notify(c);
    return ncclSuccess;
}

ncclResult_t lbw_split_gather(struct lb_comm *c, uint64_t seq, int *colors, int *keys,
                              int blocking, int *done) {
    int spins = 0;
    *done = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        int blocker = -1;
        for (int s = 0; s < c->nranks; s++) {
            if (__atomic_load_n(&c->ranks[s].split_post, __ATOMIC_ACQUIRE) < seq) {
                blocker = s;
                break;
            }
        }
        if (blocker < 0) break;
        int recheck;
        ncclResult_t r = lbw_trouble(c, blocker, &recheck);
        if (recheck) return lbw_gone(c, blocker, "ncclCommSplit");
        if (r == LB_ABORTED) return lb_err(LB_REMOTE_ERR, "ncclCommSplit : comm aborted");
        if (r != ncclSuccess) return r;
        if (!blocking) return ncclSuccess;
        lbw_backoff(c, e, &spins);
    }
    for (int s = 0; s < c->nranks; s++) {
        colors[s] = c->ranks[s].split_color;
        keys[s] = c->ranks[s].split_key;
    }
    __atomic_store_n(&c->ranks[c->rank].split_read, seq, __ATOMIC_RELEASE);
    lbw_notify(c);
    *done = 1;
    return ncclSuccess;
}

/* ---- collectives -------------------------------------------------------------------- */

static inline char *slot(struct lb_comm *c, uint64_t g, int r) {
    return c->slots + ((size_t)(g & 1) * (size_t)c->nranks + (size_t)r) * c->slot_bytes;
}

static inline void set_step(struct lb_comm *c, uint64_t v) {
    __atomic_store_n(&c->ranks[c->rank].cstep, v, __ATOMIC_RELEASE);
    lbw_notify(c);
}

/* Wait until rank `who` (or everyone, who < 0) reached phase `target`. */
static ncclResult_t wait_steps(struct lb_comm *c, int who, uint64_t target, const char *what) {
    int lo = who < 0 ? 0 : who, hi = who < 0 ? c->nranks : who + 1;
    int s = lo;
    for (; s < hi; s++)
        if (__atomic_load_n(&c->ranks[s].cstep, __ATOMIC_ACQUIRE) < target) break;
    if (s == hi) return ncclSuccess;
    int spins = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        for (; s < hi; s++)
            if (__atomic_load_n(&c->ranks[s].cstep, __ATOMIC_ACQUIRE) < target) break;
        if (s == hi) return ncclSuccess;
        int recheck;
        ncclResult_t r = lbw_trouble(c, s, &recheck);
        if (recheck) {
            if (__atomic_load_n(&c->ranks[s].cstep, __ATOMIC_ACQUIRE) >= target) continue;
            return lbw_gone(c, s, what);
        }
        if (r != ncclSuccess) return r;
        lbw_backoff(c, e, &spins);
    }
}

static int kind_has_root(int kind) {
    return kind == LB_K_BROADCAST || kind == LB_K_REDUCE || kind == LB_K_GATHER ||
           kind == LB_K_SCATTER;
}

static int kind_has_op(int kind) {
    return kind == LB_K_ALLREDUCE || kind == LB_K_REDUCE || kind == LB_K_REDUCESCATTER;
}

static void describe(char *out, size_t n, const struct lbw_desc *d) {
    int k = snprintf(out, n, "%s(count=%llu, %s", lb_kind_name(d->kind),
                     (unsigned long long)d->count, lb_type_name(d->dtype));
    if (k < 0 || (size_t)k >= n) return;
    if (kind_has_op(d->kind)) k += snprintf(out + k, n - (size_t)k, ", %s", lb_op_name(d->op));
    if ((size_t)k < n && kind_has_root(d->kind))
        k += snprintf(out + k, n - (size_t)k, ", root=%d", d->root);
    if ((size_t)k < n) snprintf(out + k, n - (size_t)k, ")");
}

static int desc_equal(const struct lbw_desc *a, const struct lbw_desc *b) {
    if (a->seq != b->seq || a->kind != b->kind || a->count != b->count || a->dtype != b->dtype)
        return 0;
    if (kind_has_op(a->kind)) {
        /* user PreMulSum ops are per-communicator handles: compare the class only */
        int ua = a->op >= ncclNumOps, ub = b->op >= ncclNumOps;
        if (ua != ub || (!ua && a->op != b->op)) return 0;
    }
    if (kind_has_root(a->kind) && a->root != b->root) return 0;
    return 1;
}

static ncclResult_t compare_descs(struct lb_comm *c, uint64_t seq) {
    const struct lbw_desc *mine = &c->ranks[c->rank].desc[seq & 1];
    for (int s = 0; s < c->nranks; s++) {
        if (s == c->rank) continue;
        const struct lbw_desc *theirs = &c->ranks[s].desc[seq & 1];
        if (desc_equal(mine, theirs)) continue;
        char a[160], b[160];
        describe(a, sizeof a, mine);
        describe(b, sizeof b, theirs);
        int rlo = c->rank < s ? c->rank : s, rhi = c->rank < s ? s : c->rank;
        lbw_break(c, ncclInvalidUsage, 1,
                  "mismatched collectives at collective #%llu of communicator %llx: rank %d called "
                  "nccl%s but rank %d called nccl%s",
                  (unsigned long long)seq, (unsigned long long)c->hash, rlo,
                  c->rank < s ? a : b, rhi, c->rank < s ? b : a);
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

#define CHECK(expr)                                   \
    do {                                              \
        ncclResult_t r_ = (expr);                     \
        if (r_ != ncclSuccess) return r_;             \
    } while (0)

/* ---- direct mode: read the peers' buffers where they are ----------------------------
 * When all ranks are threads of this process, a collective is: post a descriptor with
 * the buffer addresses, barrier, pull what this rank needs straight from the peers'
 * buffers, barrier (the peers' buffers must stay untouched until everyone pulled).
 * AllReduce reduces its own slice first and pulls the other slices from their owners'
 * receive buffers after a middle barrier. No staging copies, three waits at most.
 * (Between processes, process_vm_readv would allow the same, but it copies at about
 * half memcpy's speed here, so two memcpys through the slots win.) */

static inline const void *at(uint64_t addr, size_t off) {
    return (const char *)(uintptr_t)addr + off;
}

/* Every rank's PreMulSum scalar (posted in its descriptor for collective seq), in rank order. */
static const uint64_t *rank_scalars(struct lb_comm *c, uint64_t seq) {
    for (int s = 0; s < c->nranks; s++) c->scalars[s] = c->ranks[s].desc[seq & 1].scalar;
    return c->scalars;
}

/* The rest of a direct-mode collective, after the descriptor barrier of step 3g+1. */
static ncclResult_t exec_direct(struct lb_comm *c, const struct lb_op *op, uint64_t seq,
                                uint64_t g) {
    const uint64_t *scalars = rank_scalars(c, seq);
    const int R = c->nranks, me = c->rank, root = op->root, kind = op->kind;
    const size_t E = lb_type_size(op->dtype), count = op->count, nb = count * E;
    const char *what = lb_kind_name(kind);
    const char *sb = (const char *)op->sbuf;
    char *rb = (char *)op->rbuf;
#define SB(s) (c->ranks[s].desc[seq & 1].sbuf)
#define RB(s) (c->ranks[s].desc[seq & 1].rbuf)
    char *tmp = NULL;
    ncclResult_t r = ncclSuccess;
    switch (kind) {
    case LB_K_ALLREDUCE: {
        size_t q = (count + (size_t)R - 1) / (size_t)R;
        q = (q + 15) / 16 * 16;
        size_t lo = (size_t)me * q < count ? (size_t)me * q : count;
        size_t hi = lo + q < count ? lo + q : count;
        for (int s = 0; s < R; s++) c->srcs[s] = at(SB(s), lo * E);
        if (hi > lo) lb_reduce(op->dtype, &op->rop, scalars, NULL, rb + lo * E, c->srcs, R, hi - lo);
        set_step(c, 3 * g + 2);
        if ((r = wait_steps(c, -1, 3 * g + 2, what)) != ncclSuccess) break;
        for (int j = 0; j < R; j++) {
            size_t jl = (size_t)j * q < count ? (size_t)j * q : count;
            size_t jh = jl + q < count ? jl + q : count;
            if (j != me && jh > jl) memcpy(rb + jl * E, at(RB(j), jl * E), (jh - jl) * E);
        }
        break;
    }
    case LB_K_REDUCE:
        if (me == root) {
            for (int s = 0; s < R; s++) c->srcs[s] = at(SB(s), 0);
            lb_reduce(op->dtype, &op->rop, scalars, NULL, rb, c->srcs, R, count);
        }
        break;
    case LB_K_REDUCESCATTER:
        for (int s = 0; s < R; s++) c->srcs[s] = at(SB(s), (size_t)me * nb);
        lb_reduce(op->dtype, &op->rop, scalars, NULL, rb, c->srcs, R, count);
        break;
    case LB_K_BROADCAST:
        if (rb != at(SB(root), 0)) memcpy(rb, at(SB(root), 0), nb);
        break;
    case LB_K_ALLGATHER:
        for (int j = 0; j < R; j++)
            if (rb + (size_t)j * nb != at(SB(j), 0)) memcpy(rb + (size_t)j * nb, at(SB(j), 0), nb);
        break;
    case LB_K_ALLTOALL: {
        /* in place, a peer may still read the segment this rank overwrites: stage */
        char *out = rb;
        if (sb == rb && R > 1) {
            if (!(tmp = malloc((size_t)R * nb))) {
                r = lb_err(ncclSystemError, "loopback: out of memory for an in-place AlltoAll");
                break;
            }
            out = tmp;
        }
        for (int j = 0; j < R; j++) {
            const void *src = at(SB(j), (size_t)me * nb);
            if (out + (size_t)j * nb != src) memcpy(out + (size_t)j * nb, src, nb);
        }
        break;
    }
    case LB_K_GATHER:
        for (int j = 0; j < R && me == root; j++)
            if (rb + (size_t)j * nb != at(SB(j), 0)) memcpy(rb + (size_t)j * nb, at(SB(j), 0), nb);
        break;
    case LB_K_SCATTER:
        if (rb != at(SB(root), (size_t)me * nb)) memcpy(rb, at(SB(root), (size_t)me * nb), nb);
        break;
    default:
        r = lb_err(ncclInternalError, "loopback: unknown collective kind %d", kind);
        break;
    }
#undef SB
#undef RB
    if (r == ncclSuccess) {
        /* everyone has pulled from this rank's buffers once all reach 3g+3 */
        set_step(c, 3 * g + 3);
        r = wait_steps(c, -1, 3 * g + 3, what);
        if (r == ncclSuccess && tmp) memcpy(rb, tmp, (size_t)R * nb);
    }
    free(tmp);
    return r;
}

static ncclResult_t exec_staged(struct lb_comm *c, const struct lb_op *op, uint64_t seq);


/* Every collective starts by posting its descriptor and waiting for everyone's: the
 * mismatch check, and the choice between direct mode and staging through the slots. */
ncclResult_t lbx_exec_coll(struct lb_comm *c, const struct lb_op *op) {
    const size_t E = lb_type_size(op->dtype);
    uint64_t scalar = op->rop.scalar;
    if (op->rop.kind == LB_R_PREMULSUM && op->rop.scalar_is_ptr)
        memcpy(&scalar, op->rop.scalar_ptr, E); /* device scalar: read when the op runs */
    if (!c->probed) { /* direct mode needs every rank in this process */
        c->probed = 1;
        bool direct;
        lb_env_bool("PYNCCL_LOOPBACK_DIRECT", true, &direct, NULL, 0);
        c->direct = direct;
        for (int s = 0; s < c->nranks; s++) c->direct &= c->ranks[s].pid == c->pid;
    }
    const uint64_t seq = ++c->cseq, g = c->gchunk++;
    struct lbw_desc *d = &c->ranks[c->rank].desc[seq & 1];
    d->count = op->count;
    d->kind = op->kind;
    d->dtype = op->dtype;
    d->op = op->api_op;
    d->root = op->root;
    d->sbuf = (uint64_t)(uintptr_t)op->sbuf;
    d->rbuf = (uint64_t)(uintptr_t)op->rbuf;
    d->direct = (uint32_t)c->direct;
    d->scalar = scalar;
    d->seq = seq;
    set_step(c, 3 * g + 1);
    CHECK(wait_steps(c, -1, 3 * g + 1, lb_kind_name(op->kind)));
    CHECK(compare_descs(c, seq));
    int direct = 1;
    for (int s = 0; s < c->nranks; s++) direct &= c->ranks[s].desc[seq & 1].direct == 1;
    if (direct) return exec_direct(c, op, seq, g);
    set_step(c, 3 * g + 3); /* the preamble used this step; the slots start at the next */
    return exec_staged(c, op, seq);
}

static ncclResult_t exec_staged(struct lb_comm *c, const struct lb_op *op, uint64_t seq) {
    const uint64_t *scalars = rank_scalars(c, seq);
    const int R = c->nranks, me = c->rank, root = op->root, kind = op->kind;
    const size_t E = lb_type_size(op->dtype), count = op->count;
    const int sub = kind == LB_K_REDUCESCATTER || kind == LB_K_ALLTOALL || kind == LB_K_SCATTER;
    const size_t per = sub ? c->slot_bytes / ((size_t)R * E) : c->slot_bytes / E;
    const size_t nch = count ? (count + per - 1) / per : 1;
    const char *sb = (const char *)op->sbuf;
    char *rb = (char *)op->rbuf;
    const char *what = lb_kind_name(kind);

    for (size_t k = 0; k < nch; k++) {
        const uint64_t g = c->gchunk++;
        const size_t o = k * per, n = count ? (count - o < per ? count - o : per) : 0;
        const size_t nb = n * E;
        if (g >= 2) CHECK(wait_steps(c, -1, 3 * g - 3, what)); /* buffer g%2 free again */
        /* slices of the chunk for AllReduce / Reduce, 16-element aligned */
        size_t q = (n + (size_t)R - 1) / (size_t)R;
        q = (q + 15) / 16 * 16;

        /* phase 1: fill */
        switch (kind) {
        case LB_K_ALLREDUCE:
        case LB_K_REDUCE:
            for (int j = 0; j < R; j++) {
                size_t lo = (size_t)j * q, hi = lo + q < n ? lo + q : n;
                if (j == me || lo >= hi) continue;
                memcpy(slot(c, g, me) + lo * E, sb + (o + lo) * E, (hi - lo) * E);
            }
            break;
        case LB_K_BROADCAST:
            if (me == root && nb) {
                if (R > 1) memcpy(slot(c, g, me), sb + o * E, nb);
                if (sb != rb) memcpy(rb + o * E, sb + o * E, nb);
            }
            break;
        case LB_K_ALLGATHER:
            if (nb) {
                if (R > 1) memcpy(slot(c, g, me), sb + o * E, nb);
                char *mine = rb + ((size_t)me * count + o) * E;
                if (sb + o * E != mine) memcpy(mine, sb + o * E, nb);
            }
            break;
        case LB_K_REDUCESCATTER:
            for (int j = 0; j < R && nb; j++)
                if (j != me)
                    memcpy(slot(c, g, me) + (size_t)j * per * E, sb + ((size_t)j * count + o) * E, nb);
            break;
        case LB_K_ALLTOALL:
            for (int j = 0; j < R && nb; j++) {
                const char *src = sb + ((size_t)j * count + o) * E;
                if (j != me) {
                    memcpy(slot(c, g, me) + (size_t)j * per * E, src, nb);
                } else {
                    char *dst = rb + ((size_t)j * count + o) * E;
                    if (dst != src) memcpy(dst, src, nb);
                }
            }
            break;
        case LB_K_GATHER:
            if (nb) {
                if (me != root) {
                    memcpy(slot(c, g, me), sb + o * E, nb);
                } else {
                    char *mine = rb + ((size_t)root * count + o) * E;
                    if (mine != sb + o * E) memcpy(mine, sb + o * E, nb);
                }
            }
            break;
        case LB_K_SCATTER:
            if (me == root && nb) {
                for (int j = 0; j < R; j++) {
                    const char *src = sb + ((size_t)j * count + o) * E;
                    if (j != me) {
                        memcpy(slot(c, g, me) + (size_t)j * per * E, src, nb);
                    } else if (rb + o * E != src) {
                        memcpy(rb + o * E, src, nb);
                    }
                }
            }
            break;
        default:
            return lb_err(ncclInternalError, "loopback: unknown collective kind %d", kind);
        }
        set_step(c, 3 * g + 1);

        /* who must have filled before this rank reads */
        int who = -1;
        int need_wait = 1;
        {
            if (kind == LB_K_BROADCAST || kind == LB_K_SCATTER) {
                who = root;
                need_wait = me != root;
            } else if (kind == LB_K_GATHER) {
                need_wait = me == root;
            }
        }
        if (need_wait) CHECK(wait_steps(c, who, 3 * g + 1, what));

        /* phase 2: reduce */
        if (kind == LB_K_ALLREDUCE || kind == LB_K_REDUCE) {
            size_t lo = (size_t)me * q, hi = lo + q < n ? lo + q : n;
            if (lo < hi) {
                for (int s = 0; s < R; s++)
                    c->srcs[s] = s == me ? (const void *)(sb + (o + lo) * E)
                                         : (const void *)(slot(c, g, s) + lo * E);
                int to_rb = kind == LB_K_ALLREDUCE || me == root;
                int to_slot = R > 1 && (kind == LB_K_ALLREDUCE || me != root);
                lb_reduce(op->dtype, &op->rop, scalars, to_slot ? slot(c, g, me) + lo * E : NULL,
                          to_rb ? rb + (o + lo) * E : NULL, c->srcs, R, hi - lo);
            }
            set_step(c, 3 * g + 2);
            if (kind == LB_K_ALLREDUCE || me == root) CHECK(wait_steps(c, -1, 3 * g + 2, what));
        } else if (kind == LB_K_REDUCESCATTER) {
            if (n) {
                for (int s = 0; s < R; s++)
                    c->srcs[s] = s == me ? (const void *)(sb + ((size_t)me * count + o) * E)
                                         : (const void *)(slot(c, g, s) + (size_t)me * per * E);
                lb_reduce(op->dtype, &op->rop, scalars, NULL, rb + o * E, c->srcs, R, n);
            }
        }

        /* phase 3: drain */
        switch (kind) {
        case LB_K_ALLREDUCE:
        case LB_K_REDUCE:
            if (kind == LB_K_ALLREDUCE || me == root) {
                for (int j = 0; j < R; j++) {
                    size_t lo = (size_t)j * q, hi = lo + q < n ? lo + q : n;
                    if (j == me || lo >= hi) continue;
                    memcpy(rb + (o + lo) * E, slot(c, g, j) + lo * E, (hi - lo) * E);
                }
            }
            break;
        case LB_K_BROADCAST:
            if (me != root && nb) memcpy(rb + o * E, slot(c, g, root), nb);
            break;
        case LB_K_ALLGATHER:
            for (int j = 0; j < R && nb; j++)
                if (j != me) memcpy(rb + ((size_t)j * count + o) * E, slot(c, g, j), nb);
            break;
        case LB_K_ALLTOALL:
            for (int j = 0; j < R && nb; j++)
                if (j != me)
                    memcpy(rb + ((size_t)j * count + o) * E, slot(c, g, j) + (size_t)me * per * E,
                           nb);
            break;
        case LB_K_GATHER:
            if (me == root)
                for (int j = 0; j < R && nb; j++)
                    if (j != me) memcpy(rb + ((size_t)j * count + o) * E, slot(c, g, j), nb);
            break;
        case LB_K_SCATTER:
            if (me != root && nb) memcpy(rb + o * E, slot(c, g, root) + (size_t)me * per * E, nb);
            break;
        default:
            break;
        }
        set_step(c, 3 * g + 3);
    }
    return ncclSuccess;
}

/* ---- point to point ----------------------------------------------------------------- */

struct lb_msg {
    uint64_t magic;
    uint64_t nbytes;
    uint64_t count;
    int32_t dtype;
    int32_t src;
};

struct p2p_state {
    size_t total; /* header + payload padded to LB_MSG_HDR */
    size_t done;  /* bytes of total moved */
    int finished;
};

static inline struct lbw_ring *ring_of(struct lb_comm *c, int src, int dst) {
    return &c->rings[(size_t)src * (size_t)c->nranks + (size_t)dst];
}

static inline char *ringdata_of(struct lb_comm *c, int src, int dst) {
    return c->ringdata + ((size_t)src * (size_t)c->nranks + (size_t)dst) * c->ring_bytes;
}

static void ring_put(char *data, size_t cap, uint64_t pos, const char *src, size_t len) {
    size_t at = (size_t)(pos % cap);
    size_t first = len < cap - at ? len : cap - at;
    memcpy(data + at, src, first);
    if (len > first) memcpy(data, src + first, len - first);
}

static void ring_get(const char *data, size_t cap, uint64_t pos, char *dst, size_t len) {
    size_t at = (size_t)(pos % cap);
    size_t first = len < cap - at ? len : cap - at;
    memcpy(dst, data + at, first);
    if (len > first) memcpy(dst + first, data, len - first);
}

/* Move what can be moved now for one op; returns 1 on progress, or an error code
 * through *err. */
static int p2p_step(struct lb_comm *c, const struct lb_op *op, struct p2p_state *st,
                    ncclResult_t *err) {
    const size_t cap = c->ring_bytes;
    const size_t E = lb_type_size(op->dtype);
    const size_t nbytes = op->count * E;
    int moved = 0;
    if (op->kind == LB_K_SEND) {
        struct lbw_ring *rg = ring_of(c, c->rank, op->root);
        char *data = ringdata_of(c, c->rank, op->root);
        uint64_t head = __atomic_load_n(&rg->head, __ATOMIC_RELAXED);
        uint64_t tail = __atomic_load_n(&rg->tail, __ATOMIC_ACQUIRE);
        size_t space = cap - (size_t)(head - tail);
        if (st->done == 0) {
            if (space < LB_MSG_HDR) return 0;
            struct lb_msg m = {LB_MSG_MAGIC, nbytes, op->count, op->dtype, c->rank};
            char hdr[LB_MSG_HDR];
            memset(hdr, 0, sizeof hdr);
            memcpy(hdr, &m, sizeof m);
            ring_put(data, cap, head, hdr, LB_MSG_HDR);
            head += LB_MSG_HDR;
            space -= LB_MSG_HDR;
            st->done = LB_MSG_HDR;
            moved = 1;
        }
        size_t want = st->total - st->done;
        size_t len = want < space ? want : space;
        if (len) {
            size_t p = st->done - LB_MSG_HDR; /* payload offset */
            size_t real = p < nbytes ? (nbytes - p < len ? nbytes - p : len) : 0;
            if (real) ring_put(data, cap, head, (const char *)op->sbuf + p, real);
            head += len;
            st->done += len;
            moved = 1;
        }
        if (moved) __atomic_store_n(&rg->head, head, __ATOMIC_RELEASE);
    } else {
        struct lbw_ring *rg = ring_of(c, op->root, c->rank);
        const char *data = ringdata_of(c, op->root, c->rank);
        uint64_t tail = __atomic_load_n(&rg->tail, __ATOMIC_RELAXED);
        uint64_t head = __atomic_load_n(&rg->head, __ATOMIC_ACQUIRE);
        size_t avail = (size_t)(head - tail);
        if (st->done == 0) {
            if (avail < LB_MSG_HDR) return 0;
            struct lb_msg m;
            char hdr[LB_MSG_HDR];
            ring_get(data, cap, tail, hdr, LB_MSG_HDR);
            memcpy(&m, hdr, sizeof m);
            if (m.magic != LB_MSG_MAGIC) {
                lbw_break(c, ncclInternalError, 1, "loopback p2p ring from rank %d corrupted", op->root);
                *err = ncclInternalError;
                return 0;
            }
            if (m.nbytes != nbytes) {
                lbw_break(c, ncclInvalidUsage, 1,
                          "ncclSend/ncclRecv mismatch: rank %d sent %llu bytes (count=%llu, %s) to "
                          "rank %d, which posted a receive of %zu bytes (count=%zu, %s)",
                          m.src, (unsigned long long)m.nbytes, (unsigned long long)m.count,
                          lb_type_name(m.dtype), c->rank, nbytes, op->count,
                          lb_type_name(op->dtype));
                *err = ncclInvalidUsage;
                return 0;
            }
            tail += LB_MSG_HDR;
            avail -= LB_MSG_HDR;
            st->done = LB_MSG_HDR;
            moved = 1;
        }
        size_t want = st->total - st->done;
        size_t len = want < avail ? want : avail;
        if (len) {
            size_t p = st->done - LB_MSG_HDR;
            size_t real = p < nbytes ? (nbytes - p < len ? nbytes - p : len) : 0;
            if (real) ring_get(data, cap, tail, (char *)op->rbuf + p, real);
            tail += len;
            st->done += len;
            moved = 1;
        }
        if (moved) __atomic_store_n(&rg->tail, tail, __ATOMIC_RELEASE);
    }
    if (st->done == st->total) st->finished = 1;
    return moved;
}

ncclResult_t lbx_exec_p2p(struct lb_comm *c, const struct lb_op *ops, int n) {
    struct p2p_state stack_st[16];
    struct p2p_state *st = n <= 16 ? stack_st : calloc((size_t)n, sizeof *st);
    if (!st) return lb_err(ncclSystemError, "loopback: out of memory for %d p2p ops", n);
    for (int i = 0; i < n; i++) {
        size_t nbytes = ops[i].count * lb_type_size(ops[i].dtype);
        st[i].total = LB_MSG_HDR + (nbytes + LB_MSG_HDR - 1) / LB_MSG_HDR * LB_MSG_HDR;
        st[i].done = 0;
        st[i].finished = 0;
    }
    ncclResult_t ret = ncclSuccess;
    int spins = 0, recheck_pending = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        int progressed = 0, pending = 0, blocker = -1;
        for (int i = 0; i < n; i++) {
            if (st[i].finished) continue;
            /* ops to the same peer in the same direction go in order */
            int earlier = 0;
            for (int j = 0; j < i && !earlier; j++)
                earlier = !st[j].finished && ops[j].kind == ops[i].kind && ops[j].root == ops[i].root;
            pending++;
            if (earlier) continue;
            ncclResult_t err = ncclSuccess;
            if (p2p_step(c, &ops[i], &st[i], &err)) progressed = 1;
            if (err != ncclSuccess) {
                ret = err;
                goto out;
            }
            if (st[i].finished) pending--;
            else if (blocker < 0) blocker = ops[i].root;
        }
        if (!pending) break;
        if (progressed) {
            lbw_notify(c);
            spins = 0;
            recheck_pending = 0;
            continue;
        }
        if (recheck_pending) {
            ret = lbw_gone(c, blocker, "ncclSend/ncclRecv");
            goto out;
        }
        int recheck;
        ncclResult_t r = lbw_trouble(c, blocker, &recheck);
        if (recheck) {
            recheck_pending = 1; /* one more pass: the peer may have finished first */
            continue;
        }
        if (r != ncclSuccess) {
            ret = r;
            goto out;
        }
        lbw_backoff(c, e, &spins);
    }
out:
    if (st != stack_st) free(st);
    return ret;
}

/* PYNCCL_LOOPBACK_HANG: block until the comm is aborted (or the world breaks). */
ncclResult_t lbx_hang(struct lb_comm *c) {
    int spins = 0;
    lb_set_error("rank %d: operation #%llu hangs on purpose (PYNCCL_LOOPBACK_HANG)", c->rank,
                 (unsigned long long)c->nexec);
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        int recheck;
        ncclResult_t r = lbw_trouble(c, -1, &recheck);
        if (r != ncclSuccess) return r;
        if (spins < g_spin_pause + g_spin_yield) spins = g_spin_pause + g_spin_yield;
        lbw_backoff(c, e, &spins);
    }
}

__attribute__((constructor)) static void lb_transport_init(void) { spin_params(); }
