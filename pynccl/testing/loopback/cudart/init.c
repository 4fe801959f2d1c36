/*
 * pynccl loopback libcudart, the top of the file DAG: library load and unload, and
 * fork. Each file's fork hooks take its locks in one global order (prepare) and
 * release them in reverse (parent), or reinitialise them (child):
 *   g_graph_mu -> g_cap_mu -> g_legacy_mu -> g_streams -> g_events -> allocations.
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "internal.h"

static void fork_prepare(void) {
    lb_graph_fork_prepare();
    lb_capture_fork_prepare();
    lb_streams_fork_prepare();
    lb_events_fork_prepare();
    lb_mem_fork_prepare();
}

static void fork_parent(void) {
    lb_mem_fork_parent();
    lb_events_fork_parent();
    lb_streams_fork_parent();
    lb_capture_fork_parent();
    lb_graph_fork_parent();
}

static void fork_child(void) {
    lb_mem_fork_child();
    lb_events_fork_child();
    lb_streams_fork_child();
    lb_capture_fork_child();
    lb_graph_fork_child();
}

__attribute__((constructor)) static void lb_cudart_init(void) {
    lb_config_load();
    lb_streams_init(lb_per_thread_streams_exit);
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

__attribute__((destructor)) static void lb_cudart_fini(void) {
    atomic_store(&g_shutdown, 1);
    lb_streams_fini();
}
