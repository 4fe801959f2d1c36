/*
 * The RAS status report (ras.h) in NCCL 2.30.7's two formats: the text report (version
 * lines, job summary, communicators, errors) and the JSON document of "SET FORMAT json"
 * (nccl_version, communicators[] with ranks[] and missing_ranks[], ras{}). Every host is
 * 127.0.0.1: the loopback job runs on this one.
 */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LB_RAS_HOST "127.0.0.1"

static const char *const g_funcs[LB_RAS_NFUNCS] = {"Broadcast", "Reduce", "AllGather",
                                                   "ReduceScatter", "AllReduce"};

struct obuf {
    char *p;
    size_t n, cap;
    int oom;
};

static void put(struct obuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct obuf *b, const char *fmt, ...) {
    for (;;) {
        if (b->oom) return;
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) return;
        if (b->p && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        size_t cap = (b->cap + (size_t)k + 1) * 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
}

static const char *plural(int n, const char *one, const char *many) { return n == 1 ? one : many; }

static void version_string(char *buf, size_t n) {
    snprintf(buf, n, "%d.%d.%d", LB_NCCL_VERSION_CODE / 10000, LB_NCCL_VERSION_CODE / 100 % 100,
             LB_NCCL_VERSION_CODE % 100);
}

/* ---- JSON ---------------------------------------------------------------------------- */

static void json_rank(struct obuf *b, const struct lb_ras_rank *r) {
    put(b, "        {\n          \"rank\": %d,\n          \"host\": \"%s\",\n", r->rank, LB_RAS_HOST);
    put(b, "          \"pid\": %d,\n          \"cuda_dev\": %d,\n          \"nvml_dev\": %d,\n", r->pid,
        r->dev, r->phys);
    put(b, "          \"status\": {\n            \"init_state\": %d,\n", r->init_state);
    put(b, "            \"async_error\": %d,\n", r->async_error);
    put(b, "            \"finalize_called\": %s,\n", r->finalize_called ? "true" : "false");
    put(b, "            \"destroy_flag\": %s,\n", r->destroy_flag ? "true" : "false");
    put(b, "            \"abort_flag\": %s\n          },\n", r->abort_flag ? "true" : "false");
    put(b, "          \"collective_counts\": {\n");
    for (int f = 0; f < LB_RAS_NFUNCS; f++)
        put(b, "            \"%s\": %llu%s\n", g_funcs[f], (unsigned long long)r->counts[f],
            f < LB_RAS_NFUNCS - 1 ? "," : "");
    put(b, "          }\n        }");
}

static void json_missing(struct obuf *b, const struct lb_ras_rank *r) {
    put(b, "        {\n          \"rank\": %d,\n          \"host\": \"%s\",\n", r->rank,
        r->pid > 0 ? LB_RAS_HOST : "unknown");
    put(b, "          \"pid\": %d,\n          \"cuda_dev\": %d,\n", r->pid, r->dev);
#if LB_AT_LEAST(2, 28, 9)
    put(b, "          \"nvml_dev\": %d,\n          \"status\": {\n", r->phys);
    put(b, "            \"unresponsive\": true,\n            \"considered_dead\": %s\n          }\n",
        r->dead ? "true" : "false");
#else
    put(b, "          \"nvml_dev\": %d\n", r->phys);
#endif
    put(b, "        }");
}

static void json_report(struct obuf *b, const struct lb_ras_view *v) {
    char ver[32], ts[64];
    version_string(ver, sizeof ver);
    time_t now = time(NULL);
    struct tm tmv;
    strftime(ts, sizeof ts, "%F %T", localtime_r(&now, &tmv));
    put(b, "{\n  \"nccl_version\": \"%s\",\n", ver);
    put(b, "  \"cuda_runtime_version\": -1,\n  \"cuda_driver_version\": -1,\n");
    put(b, "  \"timestamp\": \"%s\",\n  \"communicators_count\": %d,\n", ts, v->ncomms);
    put(b, "  \"communicators\": [\n");
    for (int i = 0; i < v->ncomms; i++) {
        const struct lb_ras_comm *c = &v->comms[i];
        put(b, "%s    {\n      \"hash\": \"0x%llx\",\n", i ? ",\n" : "", (unsigned long long)c->hash);
        put(b, "      \"secondary_hash\": \"0x%llx:0x%llx\",\n", (unsigned long long)c->host_hash,
            (unsigned long long)c->pid_hash);
        put(b, "      \"size\": %d,\n      \"ranks_count\": %d,\n", c->size, c->size - c->nmissing);
        put(b, "      \"missing_ranks_count\": %d,\n      \"ranks\": [\n", c->nmissing);
        int first = 1;
        for (int s = 0; s < c->size; s++) {
            if (c->ranks[s].missing) continue;
            put(b, "%s", first ? "" : ",\n");
            json_rank(b, &c->ranks[s]);
            first = 0;
        }
        put(b, "\n      ],\n      \"missing_ranks\": [\n");
        first = 1;
        for (int s = 0; s < c->size; s++) {
            if (!c->ranks[s].missing) continue;
            put(b, "%s", first ? "" : ",\n");
            json_missing(b, &c->ranks[s]);
            first = 0;
        }
        put(b, "\n      ]\n    }");
    }
    put(b, "\n  ],\n  \"ras\": {\n    \"collection_time_sec\": %.3f,\n", v->secs);
    put(b, "    \"timeouts_count\": 0\n  }\n}\n");
}

/* ---- text ---------------------------------------------------------------------------- */

/* Distinct pids of the job (alive and dead), counted once each; the ranks' GPUs. */
static void count_processes(const struct lb_ras_view *v, int *nproc, int *ndead, int *ngpus) {
    *nproc = *ndead = *ngpus = 0;
    for (int i = 0; i < v->ncomms; i++)
        if (v->comms[i].size > *ngpus) *ngpus = v->comms[i].size;
    for (int i = 0; i < v->ncomms; i++) {
        for (int s = 0; s < v->comms[i].size; s++) {
            const struct lb_ras_rank *r = &v->comms[i].ranks[s];
            int seen = r->pid <= 0;
            for (int j = 0; j <= i && !seen; j++)
                for (int t = 0; t < (j == i ? s : v->comms[j].size) && !seen; t++)
                    seen = v->comms[j].ranks[t].pid == r->pid;
            if (seen) continue;
            (*nproc)++;
            *ndead += r->dead;
        }
    }
}

static void text_dead(struct obuf *b, const struct lb_ras_view *v, int ndead) {
    put(b, "DEAD\n  %d job process%s considered dead (unreachable via the RAS network)\n", ndead,
        plural(ndead, " is", "es are"));
    for (int i = 0; i < v->ncomms; i++) {
        for (int s = 0; s < v->comms[i].size; s++) {
            const struct lb_ras_rank *r = &v->comms[i].ranks[s];
            int again = 0;
            for (int j = 0; j <= i && !again; j++)
                for (int t = 0; t < (j == i ? s : v->comms[j].size) && !again; t++)
                    again = v->comms[j].ranks[t].pid == r->pid;
            if (r->dead && !again)
                put(b, "  Process %d on node %s managing GPU %d\n", r->pid, LB_RAS_HOST, r->dev);
        }
    }
    put(b, "\n");
}

static void text_report(struct obuf *b, const struct lb_ras_view *v) {
    char ver[32];
    version_string(ver, sizeof ver);
    int nproc, ndead, ngpus;
    count_processes(v, &nproc, &ndead, &ngpus);
    put(b, "NCCL version %s (pynccl loopback)\nCUDA runtime version -1, driver version -1\n\n", ver);
    put(b, "Job summary\n===========\n\n");
    put(b, "  Nodes  Processes         GPUs  Processes     GPUs\n");
    put(b, "(total)   per node  per process    (total)  (total)\n");
    put(b, "%7d  %9d  %11d  %9d  %7d\n", 1, nproc, nproc ? (ngpus + nproc - 1) / nproc : 0, nproc,
        ngpus);
    put(b, "\nCommunicators... (%.3fs)\n=============\n\n", v->secs);
    put(b, "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n");
    put(b, "    #  in group  per comm  per node  per comm  in group\n");
    if (v->ncomms == 0) put(b, "No communicator data collected!\n");
    for (int i = 0; i < v->ncomms; i++) {
        const struct lb_ras_comm *c = &v->comms[i];
        put(b, "%5d  %8d  %8d  %8d  %8d  %8d  %8s  %6s\n", i, 1, 1, c->size, c->size, c->size,
            "RUNNING", c->nmissing ? "INCOMPLETE" : "OK");
    }
    put(b, "\nErrors\n======\n\n");
    if (ndead) text_dead(b, v, ndead);
    for (int i = 0; i < v->ncomms; i++) {
        const struct lb_ras_comm *c = &v->comms[i];
        if (!c->nmissing) continue;
        put(b, "#%d-0 (%016llx) INCOMPLETE\n  Missing communicator data from %d rank%s\n", i,
            (unsigned long long)c->hash, c->nmissing, plural(c->nmissing, "", "s"));
        for (int s = 0; s < c->size; s++) {
            const struct lb_ras_rank *r = &c->ranks[s];
            if (!r->missing) continue;
            if (r->pid > 0)
                put(b, "  Rank %d -- GPU %d managed by process %d on node %s\n", r->rank, r->dev,
                    r->pid, LB_RAS_HOST);
            else
                put(b, "  Rank %d -- [process information not found]\n", r->rank);
        }
        put(b, "\n");
    }
}

char *lb_ras_format(const struct lb_ras_view *view, int json, int verbose) {
    (void)verbose; /* the loopback's report has no outliers to elide */
    struct obuf b = {0};
    if (json)
        json_report(&b, view);
    else
        text_report(&b, view);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}
