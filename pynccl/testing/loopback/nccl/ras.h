/*
 * NCCL's RAS client service as the loopback answers it (ras.c: registry, listener
 * thread, protocol; ras_fmt.c: the text and JSON reports). The protocol and the fields
 * follow NCCL 2.30.7's src/ras/client_support.cc: "CLIENT PROTOCOL n" -> "SERVER
 * PROTOCOL 2", "TIMEOUT n" -> "OK", "SET FORMAT text|json" -> "OK" (2.28.7 and later),
 * "[VERBOSE ]STATUS" -> the report, then the server closes the connection.
 */
#ifndef PYNCCL_LB_RAS_H
#define PYNCCL_LB_RAS_H

#include <stddef.h>
#include <stdint.h>

#define LB_RAS_NFUNCS 5 /* NCCL_NUM_FUNCTIONS: Broadcast Reduce AllGather ReduceScatter AllReduce */

/* One rank of a communicator as this process sees it in the shared world. */
struct lb_ras_rank {
    int rank, pid, dev, phys;
    int init_state, async_error;
    int finalize_called, destroy_flag, abort_flag;
    int missing, dead; /* missing: no data from it; dead: its process is gone */
    uint64_t counts[LB_RAS_NFUNCS];
};

struct lb_ras_comm {
    uint64_t hash, host_hash, pid_hash;
    int size, nmissing;
    struct lb_ras_rank *ranks; /* size entries, in rank order */
};

/* A snapshot of every communicator this process is a member of. */
struct lb_ras_view {
    int ncomms;
    struct lb_ras_comm *comms;
    double secs; /* time taken to collect it */
};

/* The report for `view`, NUL-terminated, malloc'ed (NULL when out of memory). */
char *lb_ras_format(const struct lb_ras_view *view, int json, int verbose);

#endif
