/*
 * pynccl loopback libcudart: graphs and executable graphs. A graph is the list of
 * nodes a capture recorded (capture.c), in capture order; cudaGraphInstantiate copies
 * them (clone(arg, 0)), and cudaGraphLaunch enqueues a fresh copy of each node
 * (clone(arg, 1)) on the launch stream, in that order.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "internal.h"

struct CUgraph_st {
    lb_node *nodes;
    size_t n;
};

struct CUgraphExec_st {
    lb_node *nodes;
    size_t n;
    atomic_int refs; /* the handle's, plus one per launch in progress */
};

static pthread_mutex_t g_graph_mu = PTHREAD_MUTEX_INITIALIZER;
static lb_ptrset g_graphs, g_execs;

/* Template copies of nodes[0..n) (clone(arg, 0)); NULL when out of memory. */
static lb_node *nodes_clone(const lb_node *nodes, size_t n) {
    lb_node *copy = malloc((n ? n : 1) * sizeof *copy);
    if (copy == NULL) return NULL;
    for (size_t i = 0; i < n; i++) {
        copy[i] = nodes[i];
        copy[i].arg = nodes[i].clone(nodes[i].arg, 0);
        if (copy[i].arg == NULL) {
            lb_nodes_release(copy, i);
            return NULL;
        }
    }
    return copy;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (pGraph == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "pGraph is NULL");
    *pGraph = NULL;
    struct CUstream_st *s;
    if ((err = lb_stream_get(stream, __func__, &s))) return err;
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (g == NULL) {
        lb_stream_put(s);
        return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    }
    err = lb_capture_end(s, __func__, &g->nodes, &g->n);
    lb_stream_put(s);
    if (!err) {
        pthread_mutex_lock(&g_graph_mu);
        bool ok = ptrset_add(&g_graphs, g);
        pthread_mutex_unlock(&g_graph_mu);
        if (ok) {
            *pGraph = g;
            return cudaSuccess;
        }
        err = lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    }
    lb_nodes_release(g->nodes, g->n);
    free(g);
    return err;
}

static cudaError_t graph_get(cudaGraph_t graph, const char *fn) {
    if (graph == NULL) return lb_fail(cudaErrorInvalidValue, fn, "graph is NULL");
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph,
                                 unsigned long long flags) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if (pGraphExec == NULL) return lb_fail(cudaErrorInvalidValue, __func__, "pGraphExec is NULL");
    *pGraphExec = NULL;
    if ((err = graph_get(graph, __func__))) return err;
    if (flags != 0)
        return lb_fail(cudaErrorInvalidValue, __func__,
                       "flags=%#llx (the loopback supports no instantiation flags)", flags);
    struct CUgraphExec_st *x = calloc(1, sizeof *x);
    if (x == NULL) return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
    atomic_init(&x->refs, 1);
    /* The graph lock is held across the clones so that the graph cannot be destroyed
     * under them; clone callbacks never call back into the graph API. */
    pthread_mutex_lock(&g_graph_mu);
    bool live = ptrset_has(&g_graphs, graph);
    if (live) {
        x->nodes = nodes_clone(graph->nodes, graph->n);
        x->n = graph->n;
        if (x->nodes != NULL && !ptrset_add(&g_execs, x)) {
            pthread_mutex_unlock(&g_graph_mu);
            lb_nodes_release(x->nodes, x->n);
            free(x);
            return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
        }
    }
    pthread_mutex_unlock(&g_graph_mu);
    if (!live) {
        free(x);
        return lb_fail(cudaErrorInvalidValue, __func__, "graph %p is not a live graph",
                       (void *)graph);
    }
    if (x->nodes == NULL) {
        free(x);
        return lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory copying nodes");
    }
    *pGraphExec = x;
    return cudaSuccess;
}

static void exec_put(struct CUgraphExec_st *x) {
    if (atomic_fetch_sub(&x->refs, 1) != 1) return;
    lb_nodes_release(x->nodes, x->n);
    free(x);
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    pthread_mutex_lock(&g_graph_mu);
    bool live = graphExec != NULL && ptrset_has(&g_execs, graphExec);
    if (live) atomic_fetch_add(&graphExec->refs, 1);
    pthread_mutex_unlock(&g_graph_mu);
    if (!live)
        return lb_fail(cudaErrorInvalidValue, __func__,
                       "graphExec %p is not a live executable graph", (void *)graphExec);
    struct CUstream_st *s;
    if ((err = lb_stream_get(stream, __func__, &s))) {
        exec_put(graphExec);
        return err;
    }
    /* Launched into a capturing stream, the graph's nodes become nodes of that capture
     * (CUDA makes a child-graph node: the same order). */
    int capturing = lb_capture_active(s);
    for (size_t i = 0; i < graphExec->n && !err; i++) {
        const lb_node *node = &graphExec->nodes[i];
        void *arg = node->clone(node->arg, !capturing);
        if (arg == NULL) {
            err = lb_fail(cudaErrorMemoryAllocation, __func__, "out of host memory");
            break;
        }
        err = lb_stream_push(s, node->run, node->release, node->clone, arg, NULL, capturing);
        if (err) {
            if (node->release != NULL) node->release(arg);
            err = lb_push_fail(err, __func__, (void *)stream);
        }
    }
    lb_stream_put(s);
    exec_put(graphExec);
    return err;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    pthread_mutex_lock(&g_graph_mu);
    bool live = graphExec != NULL && ptrset_del(&g_execs, graphExec);
    pthread_mutex_unlock(&g_graph_mu);
    if (!live)
        return lb_fail(cudaErrorInvalidValue, __func__,
                       "graphExec %p is not a live executable graph (destroyed twice?)",
                       (void *)graphExec);
    exec_put(graphExec); /* launches already enqueued own their copies */
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    cudaError_t err = lb_check_usable(__func__);
    if (err) return err;
    if ((err = graph_get(graph, __func__))) return err;
    pthread_mutex_lock(&g_graph_mu);
    bool live = ptrset_del(&g_graphs, graph);
    pthread_mutex_unlock(&g_graph_mu);
    if (!live)
        return lb_fail(cudaErrorInvalidValue, __func__,
                       "graph %p is not a live graph (destroyed twice?)", (void *)graph);
    /* Executable graphs made from it hold their own copies, as in CUDA. */
    lb_nodes_release(graph->nodes, graph->n);
    free(graph);
    return cudaSuccess;
}

/* ---- fork ------------------------------------------------------------------------ */

LB_HIDDEN void lb_graph_fork_prepare(void) { pthread_mutex_lock(&g_graph_mu); }

LB_HIDDEN void lb_graph_fork_parent(void) { pthread_mutex_unlock(&g_graph_mu); }

LB_HIDDEN void lb_graph_fork_child(void) { pthread_mutex_init(&g_graph_mu, NULL); }
