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
    h->sig_off = off; /* one-sided signal counts (signal.c) */
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

/* Reserve [p, p + n) of a shared mapping without changing its bytes (a peer may already be
 * using it); 0 or the errno (ENOMEM, EFAULT: no room) instead of a later SIGBUS. */
int lbw_populate(char *p, size_t n) {
    if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno != EINVAL) return errno;
    long page = sysconf(_SC_PAGESIZE);
    for (size_t off = 0; off < n; off += (size_t)page) __atomic_fetch_or(p + off, 0, __ATOMIC_RELAXED);
    return 0;
}

/* Create the world as its creator: size and fill a fresh memfd, map it. The p2p ring data
 * (nranks^2 rings) is reserved pair by pair at a sender's first send to a peer (p2p.c), as
 * NCCL connects p2p at runtime (NCCL_RUNTIME_CONNECT): reserving it all here made init
 * quadratic in the ranks (1 GiB of pages zeroed at 256 ranks). */
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
    int e = ftruncate(fd, (off_t)size) == 0 ? posix_fallocate(fd, 0, (off_t)h.ringdata_off) : errno;
    if (e == 0 && size > h.sig_off)
        e = posix_fallocate(fd, (off_t)h.sig_off, (off_t)(size - h.sig_off));
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
    if ((int)n == c->nranks) { /* a 1-rank world, or the last: the waiters' condition holds */
        lbw_rendezvous_close(c);
        lbw_notify(c);
    } /* earlier joins wake no one: n arrivals waking n waiters each was a futex storm */
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

/* NCCL compares the busId: one device is one GPU whatever the process and whatever
 * CUDA_VISIBLE_DEVICES renumbered it to. Reports the pair (a, b) with the lowest a, then
 * the lowest b, in one pass over the ranks (first[] holds a device's lowest rank). */
static ncclResult_t duplicate_gpu_check(struct lb_comm *c, const char *opname) {
    int ndev = 0;
    for (int s = 0; s < c->nranks; s++)
        if (c->ranks[s].phys >= ndev) ndev = c->ranks[s].phys + 1;
    int *first = malloc(((size_t)ndev + 1) * sizeof *first);
    if (!first) return lb_err(ncclSystemError, "%s : out of memory", opname);
    for (int d = 0; d < ndev; d++) first[d] = -1;
    int a = c->nranks, b = -1;
    for (int s = 0; s < c->nranks; s++) {
        int d = c->ranks[s].phys;
        if (d < 0) continue; /* not a loopback device: nothing to compare */
        if (first[d] < 0) first[d] = s;
        else if (first[d] < a) a = first[d], b = s;
    }
    free(first);
    if (b < 0) return ncclSuccess;
    return lb_err(ncclInvalidUsage,
                  "%s : Duplicate GPU detected : rank %d and rank %d both on loopback "
                  "physical device %d (processes %d and %d; call cudaSetDevice with a "
                  "distinct device per rank, or set PYNCCL_LOOPBACK_STRICT=0)",
                  opname, a, b, c->ranks[a].phys, (int)c->ranks[a].pid, (int)c->ranks[b].pid);
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
    return duplicate_gpu_check(c, opname);
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
        lb_init_report(c, opname, 1);
        int miss = first_missing(c);
        lbw_break(c, LB_REMOTE_ERR, 1,
                  "%s : timed out waiting for rank %d of %d to join (PYNCCL_LOOPBACK_INIT_TIMEOUT)",
                  opname, miss, c->nranks);
        return LB_REMOTE_ERR;
    }
    lb_init_report(c, opname, 0);
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

void lbw_depart(struct lb_comm *c, enum lbw_rank_state state) {
    if (!c->w) return;
    if (c->ranks) {
        uint32_t *st = &c->ranks[c->rank].state;
        uint32_t cur = __atomic_load_n(st, __ATOMIC_ACQUIRE);
        while (cur != LBR_LEFT && cur != LBR_FAILED &&
               !__atomic_compare_exchange_n(st, &cur, (uint32_t)state, 0, __ATOMIC_SEQ_CST,
                                            __ATOMIC_SEQ_CST)) {
        }
        lbw_notify(c);
    }
    lbw_rendezvous_close(c);
}

void lbw_leave(struct lb_comm *c, enum lbw_rank_state state) {
    struct lbw_hdr *w = c->w;
    if (!w) return;
    lbw_depart(c, state);
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

/* Wait until every rank has posted split seq (`posts`), or has read everyone's post of
 * split seq-1 (!`posts`). Without `blocking`: one look. *ready says whether it holds. */
static ncclResult_t split_wait(struct lb_comm *c, uint64_t seq, int posts, int blocking,
                               int *ready) {
    int spins = 0;
    *ready = 0;
    for (;;) {
        uint32_t e = __atomic_load_n(&c->w->epoch, __ATOMIC_SEQ_CST);
        int blocker = -1;
        for (int s = 0; s < c->nranks; s++) {
            const uint64_t *at = posts ? &c->ranks[s].split_post : &c->ranks[s].split_read;
            uint64_t have = __atomic_load_n(at, __ATOMIC_ACQUIRE);
            if (posts ? have < seq : have + 1 < seq) {
                blocker = s;
                break;
            }
        }
        if (blocker < 0) {
            *ready = 1;
            return ncclSuccess;
        }
        int recheck;
        ncclResult_t r = lbw_trouble(c, blocker, &recheck);
        if (recheck) return lbw_gone(c, blocker, "ncclCommSplit");
        if (r == LB_ABORTED) return lb_err(LB_REMOTE_ERR, "ncclCommSplit : comm aborted");
        if (r != ncclSuccess) return r;
        if (!blocking) return ncclSuccess;
        lbw_backoff(c, e, &spins);
    }
}

ncclResult_t lbw_split_post(struct lb_comm *c, uint64_t seq, int color, int key) {
    /* Everyone must have read split seq-1 before this rank overwrites its post. */
    int ready;
    ncclResult_t r = split_wait(c, seq, 0, 1, &ready);
    if (r != ncclSuccess) return r;
    struct lbw_rank *me = &c->ranks[c->rank];
    me->split_color = color;
    me->split_key = key;
    __atomic_store_n(&me->split_post, seq, __ATOMIC_RELEASE);
    lbw_notify(c);
    return ncclSuccess;
}

ncclResult_t lbw_split_gather(struct lb_comm *c, uint64_t seq, int *colors, int *keys,
                              int blocking, int *done) {
    *done = 0;
    int ready;
    ncclResult_t r = split_wait(c, seq, 1, blocking, &ready);
    if (r != ncclSuccess || !ready) return r;
    for (int s = 0; s < c->nranks; s++) {
        colors[s] = c->ranks[s].split_color;
        keys[s] = c->ranks[s].split_key;
    }
    __atomic_store_n(&c->ranks[c->rank].split_read, seq, __ATOMIC_RELEASE);
    lbw_notify(c);
    *done = 1;
    return ncclSuccess;
}
