/*
 * The calling thread's open group (ncclGroupStart ... ncclGroupEnd): its depth, first
 * error, blocking mode and the items queued in it. ncclGroupEnd, which launches them,
 * is in launch.c.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- thread-local groups -------------------------------------------------------------- */

static __thread int t_depth;
static __thread int t_err;
static __thread int t_blocking = -1;
static __thread struct lb_gitem *t_items;
static __thread int t_n, t_cap;

int lb_group_depth(void) { return t_depth; }

ncclResult_t lb_group_error(ncclResult_t r) {
    if (r != ncclSuccess && r != ncclInProgress && t_depth > 0 && t_err == ncclSuccess) t_err = r;
    return r;
}

ncclResult_t lb_group_join_mode(int blocking, const char *opname) {
    if (t_depth == 0) return ncclSuccess;
    if (t_blocking < 0) {
        t_blocking = blocking;
    } else if (t_blocking != blocking) {
        return lb_group_error(lb_err(ncclInvalidArgument,
                                     "%s : Blocking and nonblocking communicators are not allowed "
                                     "in the same group.",
                                     opname));
    }
    return ncclSuccess;
}

ncclResult_t lb_group_push(const struct lb_gitem *it) {
    if (t_n == t_cap) {
        int cap = t_cap ? 2 * t_cap : 16;
        struct lb_gitem *n = realloc(t_items, (size_t)cap * sizeof *n);
        if (!n) return lb_group_error(lb_err(ncclSystemError, "ncclGroup : out of memory"));
        t_items = n;
        t_cap = cap;
    }
    t_items[t_n++] = *it;
    if (it->c) lb_comm_ref(it->c);
    return ncclSuccess;
}

ncclResult_t lb_group_defer_init(struct lb_comm *c) {
    struct lb_gitem it;
    memset(&it, 0, sizeof it);
    it.type = LBG_INIT;
    it.c = c;
    return lb_group_push(&it);
}

ncclResult_t lb_group_defer_split(struct lb_split *s) {
    struct lb_gitem it;
    memset(&it, 0, sizeof it);
    it.type = LBG_SPLIT;
    it.split = s;
    ncclResult_t r = lb_group_push(&it);
    if (r != ncclSuccess) lb_split_free(s);
    return r;
}

void lb_group_release(struct lb_gitem *items, int n) {
    for (int i = 0; i < n; i++) {
        if (items[i].type == LBG_SPLIT && items[i].split) lb_split_free(items[i].split);
        if (items[i].c) lb_comm_unref(items[i].c);
    }
    free(items);
}


ncclResult_t ncclGroupStart(void) {
    if (t_depth == 0) {
        t_err = ncclSuccess;
        t_blocking = -1;
    }
    t_depth++;
    return ncclSuccess;
}
LB_ALIAS(ncclGroupStart)

/* Pop one level; at the outermost, hand the items to *items (NULL when nested) and the
 * group's first error to *err (cleared here). */
ncclResult_t lb_group_pop(struct lb_gitem **items, int *n, int *blocking, ncclResult_t *err) {
    *items = NULL;
    *n = 0;
    *err = ncclSuccess;
    if (t_depth == 0) return lb_err(ncclInvalidUsage, "ncclGroupEnd: not in a group call.");
    if (--t_depth > 0) return ncclSuccess;
    *items = t_items;
    *n = t_n;
    *blocking = t_blocking != 0;
    *err = (ncclResult_t)t_err;
    t_err = ncclSuccess;
    t_items = NULL;
    t_n = t_cap = 0;
    return ncclSuccess;
}
