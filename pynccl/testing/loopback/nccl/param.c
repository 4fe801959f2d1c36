/*
 * The parameter API of the loopback libnccl (ncclParam*, NCCL 2.30.3+).
 *
 * NCCL 2.32.3 registers 7 parameters before any communicator exists (the debug
 * subsystem's); the rest appear as the library initialises. The loopback has no other
 * subsystems, so it serves exactly those 7, with NCCL's types, defaults, value strings
 * and binary layouts, read from the environment at each call:
 *
 *   const char*        NCCL_DEBUG_FILE, NCCL_DEBUG_TIMESTAMP_FORMAT
 *   uint32_t (levels)  NCCL_DEBUG_TIMESTAMP_LEVELS, NCCL_DEBUG_LEVELS
 *   bool               NCCL_SET_THREAD_NAME
 *   uint64_t (subsys)  NCCL_DEBUG_SUBSYS
 *   ncclDebugLogLevel  NCCL_DEBUG ("<unknown>" until set, as before NCCL's init)
 *
 * Typed getters accept only the parameter's own type (NCCL's rule: a uint32_t reads
 * with ncclParamGetU32 only, a string with ncclParamGetStr only); ncclParamGet copies
 * the native bytes. A malformed environment value falls back to the default.
 */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#if LB_AT_LEAST(2, 30, 3)

enum lbp_type { LBP_STR, LBP_LEVELS, LBP_BOOL, LBP_SUBSYS, LBP_DEBUG };

struct ncclParamHandle {
    const char *key;
    int type;
    const char *dflt; /* default as NCCL prints it */
    const char *desc;
    const char *accepted;
};

static const struct ncclParamHandle k_params[] = {
    {"NCCL_DEBUG_FILE", LBP_STR, "<unset>",
     "Set the NCCL debug logging output to a file. The filename format can be set to "
     "filename.%h.%p where %h is replaced with the hostname and %p is replaced with the process PID.",
     "String"},
    {"NCCL_DEBUG_TIMESTAMP_FORMAT", LBP_STR, "[%F %T] ",
     "Set the format used when printing debug log messages", "String"},
    {"NCCL_DEBUG_TIMESTAMP_LEVELS", LBP_LEVELS, "WARN,ATTN",
     "Set the log levels that include timestamps.",
     "Comma-separated list of: VERSION, WARN, ATTN, INFO, ABORT, TRACE, ALL"},
    {"NCCL_SET_THREAD_NAME", LBP_BOOL, "FALSE",
     "Allow NCCL to give meaningful names to NCCL CPU threads via pthread_setname_np",
     "Boolean: 1/T/TRUE or 0/F/FALSE"},
    {"NCCL_DEBUG_SUBSYS", LBP_SUBSYS, "INIT,ENV,BOOTSTRAP", "Filter debug output by (comma-separated)",
     "Comma-separated list of subsystems, ^ to exclude, ALL"},
    {"NCCL_DEBUG_LEVELS", LBP_LEVELS, "NONE", "Set the log levels to print.",
     "Comma-separated list of: VERSION, WARN, ATTN, INFO, ABORT, TRACE, ALL"},
    {"NCCL_DEBUG", LBP_DEBUG, "<unknown>",
     "Set the debug output level. Each level includes less-verbose levels.",
     "One of: VERSION, WARN, INFO, ABORT, TRACE"},
};
#define LBP_N ((int)(sizeof k_params / sizeof k_params[0]))

static const char *const k_type_name[] = {"const char*", "uint32_t", "bool", "uint64_t",
                                          "ncclDebugLogLevel"};

/* Level bits: 1 << ncclDebugLogLevel (VERSION 1 .. TRACE 5), ATTN 1 << 6. */
static const struct {
    const char *name;
    uint64_t bit;
} k_levels[] = {{"VERSION", 1u << 1}, {"WARN", 1u << 2}, {"ATTN", 1u << 6},
                {"INFO", 1u << 3},    {"ABORT", 1u << 4}, {"TRACE", 1u << 5}},
  k_subsys[] = {{"INIT", 1},           {"COLL", 2},          {"P2P", 4},          {"SHM", 8},
                {"NET", 16},           {"GRAPH", 32},        {"TUNING", 64},      {"ENV", 128},
                {"ALLOC", 256},        {"ALLOC_HOST", 1u << 16}, {"CALL", 512}, {"PROXY", 1024},
                {"NVLS", 2048},        {"BOOTSTRAP", 4096},  {"REG", 8192},       {"PROFILE", 16384},
                {"RAS", 32768},        {"DESTROY", 1u << 17}};
#define LB_NLEVELS 6
#define LB_NSUBSYS 18
#define LB_LEVELS_ALL 0x7eu

/* A comma list of names into a mask; 0 on a name it does not know. */
static int parse_mask(const char *s, int subsys, uint64_t *out) {
    int invert = 0;
    if (subsys && *s == '^') {
        invert = 1;
        s++;
    }
    uint64_t m = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        int n = subsys ? LB_NSUBSYS : LB_NLEVELS, found = 0;
        if (!strcasecmp(tok, "ALL")) {
            m |= subsys ? ~0ULL : LB_LEVELS_ALL;
            continue;
        }
        if (!subsys && !strcasecmp(tok, "NONE")) continue;
        for (int i = 0; i < n; i++) {
            const char *nm = subsys ? k_subsys[i].name : k_levels[i].name;
            if (!strcasecmp(tok, nm)) {
                m |= subsys ? k_subsys[i].bit : k_levels[i].bit;
                found = 1;
            }
        }
        if (!found) return 0;
    }
    *out = invert ? ~m : m;
    return 1;
}

static void print_mask(uint64_t m, int subsys, char *out, size_t n) {
    out[0] = 0;
    if (!subsys && m == 0) {
        snprintf(out, n, "NONE");
        return;
    }
    if (!subsys && (m & LB_LEVELS_ALL) == LB_LEVELS_ALL) {
        snprintf(out, n, "ALL");
        return;
    }
    size_t k = 0;
    int cnt = subsys ? LB_NSUBSYS : LB_NLEVELS;
    for (int i = 0; i < cnt; i++) {
        uint64_t b = subsys ? k_subsys[i].bit : k_levels[i].bit;
        if (m & b) k += (size_t)snprintf(out + k, k < n ? n - k : 0, "%s%s", k ? "," : "",
                                         subsys ? k_subsys[i].name : k_levels[i].name);
    }
}

static int parse_bool(const char *s, uint8_t *out) {
    if (!strcmp(s, "1") || !strcasecmp(s, "T") || !strcasecmp(s, "TRUE")) return *out = 1, 1;
    if (!strcmp(s, "0") || !strcasecmp(s, "F") || !strcasecmp(s, "FALSE")) return *out = 0, 1;
    return 0;
}

static const char *const k_debug_names[] = {"NONE", "VERSION", "WARN", "INFO", "ABORT", "TRACE"};

/* A parameter's current value: the string NCCL prints, its native bytes, where from. */
struct lbp_value {
    char str[512];
    unsigned char raw[512];
    int rawlen;
    int from_env;
};

static void value_of(const struct ncclParamHandle *p, struct lbp_value *v) {
    const char *env = getenv(p->key);
    memset(v, 0, sizeof *v);
    switch (p->type) {
    case LBP_STR: {
        const char *s = env ? env : (strcmp(p->dflt, "<unset>") ? p->dflt : "");
        v->from_env = env != NULL;
        snprintf(v->str, sizeof v->str, "%s", s);
        v->rawlen = (int)strlen(v->str) + 1;
        memcpy(v->raw, v->str, (size_t)v->rawlen);
        break;
    }
    case LBP_LEVELS:
    case LBP_SUBSYS: {
        int subsys = p->type == LBP_SUBSYS;
        uint64_t m = 0;
        parse_mask(p->dflt, subsys, &m);
        if (env && parse_mask(env, subsys, &m)) v->from_env = 1;
        if (!subsys) m &= 0xffffffffu;
        print_mask(m, subsys, v->str, sizeof v->str);
        if (subsys) {
            memcpy(v->raw, &m, 8);
            v->rawlen = 8;
        } else {
            uint32_t m32 = (uint32_t)m;
            memcpy(v->raw, &m32, 4);
            v->rawlen = 4;
        }
        break;
    }
    case LBP_BOOL: {
        uint8_t b = 0;
        if (env && parse_bool(env, &b)) v->from_env = 1;
        snprintf(v->str, sizeof v->str, "%s", b ? "TRUE" : "FALSE");
        v->raw[0] = b;
        v->rawlen = 1;
        break;
    }
    default: { /* LBP_DEBUG */
        int32_t level = 0;
        snprintf(v->str, sizeof v->str, "<unknown>");
        for (int i = 0; env && i < 6; i++) {
            if (!strcasecmp(env, k_debug_names[i])) {
                level = i;
                v->from_env = 1;
                snprintf(v->str, sizeof v->str, "%s", k_debug_names[i]);
            }
        }
        memcpy(v->raw, &level, 4);
        v->rawlen = 4;
        break;
    }
    }
}

static const struct ncclParamHandle *find(const char *key) {
    for (int i = 0; i < LBP_N; i++)
        if (!strcmp(k_params[i].key, key)) return &k_params[i];
    return NULL;
}

static const struct ncclParamHandle *valid(ncclParamHandle_t h) {
    for (int i = 0; i < LBP_N; i++)
        if (h == &k_params[i]) return h;
    return NULL;
}

ncclResult_t ncclParamBind(ncclParamHandle_t *out, const char *key) {
    if (out == NULL || key == NULL)
        return lb_err(ncclInvalidArgument, "ncclParamBind : invalid arguments out %p key %p",
                      (void *)out, (const void *)key);
    const struct ncclParamHandle *p = find(key);
    if (!p) return lb_err(ncclInvalidArgument, "ncclParamBind : no parameter named %s", key);
    *out = (ncclParamHandle_t)p;
    return ncclSuccess;
}
LB_ALIAS(ncclParamBind)

static ncclResult_t typed_get(ncclParamHandle_t h, void *out, int type, size_t size,
                              const char *tname, const char *opname) {
    const struct ncclParamHandle *p = valid(h);
    if (!p || !out) return lb_err(ncclInvalidArgument, "%s : invalid handle %p or out %p", opname,
                                  (void *)h, out);
    if (p->type != type || (type == LBP_LEVELS && size != 4) || (type == LBP_SUBSYS && size != 8))
        return lb_err(ncclInvalidArgument, "%s : %s is of type %s, not %s", opname, p->key,
                      k_type_name[p->type], tname);
    struct lbp_value v;
    value_of(p, &v);
    memcpy(out, v.raw, size);
    return ncclSuccess;
}

/* Only NCCL's uint32_t and uint64_t parameters have integer getters here. */
#define LB_PARAM_GET(NAME, T, TYPE)                                            \
    ncclResult_t NAME(ncclParamHandle_t h, T *out) {                           \
        return typed_get(h, out, TYPE, sizeof(T), #T, #NAME);                  \
    }                                                                          \
    LB_ALIAS(NAME)

LB_PARAM_GET(ncclParamGetI8, int8_t, -1)
LB_PARAM_GET(ncclParamGetI16, int16_t, -1)
LB_PARAM_GET(ncclParamGetI32, int32_t, -1)
LB_PARAM_GET(ncclParamGetI64, int64_t, -1)
LB_PARAM_GET(ncclParamGetU8, uint8_t, -1)
LB_PARAM_GET(ncclParamGetU16, uint16_t, -1)

ncclResult_t ncclParamGetU32(ncclParamHandle_t h, uint32_t *out) {
    return typed_get(h, out, LBP_LEVELS, 4, "uint32_t", "ncclParamGetU32");
}
LB_ALIAS(ncclParamGetU32)

ncclResult_t ncclParamGetU64(ncclParamHandle_t h, uint64_t *out) {
    return typed_get(h, out, LBP_SUBSYS, 8, "uint64_t", "ncclParamGetU64");
}
LB_ALIAS(ncclParamGetU64)

static __thread char t_str[512];

ncclResult_t ncclParamGetStr(ncclParamHandle_t h, const char **out) {
    const struct ncclParamHandle *p = valid(h);
    if (!p || !out)
        return lb_err(ncclInvalidArgument, "ncclParamGetStr : invalid handle %p or out %p",
                      (void *)h, (void *)out);
    if (p->type != LBP_STR)
        return lb_err(ncclInvalidArgument, "ncclParamGetStr : %s is of type %s, not a string",
                      p->key, k_type_name[p->type]);
    struct lbp_value v;
    value_of(p, &v);
    memcpy(t_str, v.str, sizeof t_str);
    *out = t_str;
    return ncclSuccess;
}
LB_ALIAS(ncclParamGetStr)

ncclResult_t ncclParamGet(ncclParamHandle_t h, void *out, int maxLen, int *len) {
    const struct ncclParamHandle *p = valid(h);
    if (!p || !out || !len)
        return lb_err(ncclInvalidArgument, "ncclParamGet : invalid arguments h %p out %p len %p",
                      (void *)h, out, (void *)len);
    struct lbp_value v;
    value_of(p, &v);
    if (maxLen < v.rawlen) {
        *len = 0;
        return lb_err(ncclInvalidArgument, "ncclParamGet : %s needs %d bytes, maxLen is %d", p->key,
                      v.rawlen, maxLen);
    }
    memcpy(out, v.raw, (size_t)v.rawlen);
    *len = v.rawlen;
    return ncclSuccess;
}
LB_ALIAS(ncclParamGet)

static __thread char t_value[512];

ncclResult_t ncclParamGetParameter(const char *key, const char **value, int *valueLen) {
    if (!key || !value || !valueLen)
        return lb_err(ncclInvalidArgument, "ncclParamGetParameter : invalid arguments key %p value "
                      "%p valueLen %p", (const void *)key, (void *)value, (void *)valueLen);
    const struct ncclParamHandle *p = find(key);
    if (!p) return lb_err(ncclInvalidArgument, "ncclParamGetParameter : no parameter named %s", key);
    struct lbp_value v;
    value_of(p, &v);
    memcpy(t_value, v.str, sizeof t_value);
    *value = t_value;
    *valueLen = (int)strlen(t_value);
    return ncclSuccess;
}
LB_ALIAS(ncclParamGetParameter)

static __thread const char *t_keys[LBP_N];

ncclResult_t ncclParamGetAllParameterKeys(const char ***table, int *tableLen) {
    if (!table || !tableLen)
        return lb_err(ncclInvalidArgument, "ncclParamGetAllParameterKeys : invalid arguments table "
                      "%p tableLen %p", (void *)table, (void *)tableLen);
    for (int i = 0; i < LBP_N; i++) t_keys[i] = k_params[i].key;
    *table = t_keys;
    *tableLen = LBP_N;
    return ncclSuccess;
}
LB_ALIAS(ncclParamGetAllParameterKeys)

void ncclParamDumpAll(void) {
    printf("=== ncclParam Registry Dump ===\n");
    for (int i = 0; i < LBP_N; i++) {
        const struct ncclParamHandle *p = &k_params[i];
        struct lbp_value v;
        value_of(p, &v);
        const char *shown = v.str[0] || p->type != LBP_STR ? v.str : "<unset>";
        printf("%s (%s) %s\n    Current value=%s set_by=%s default=%s\n    Accepted value: %s\n\n",
               p->key, k_type_name[p->type], p->desc, shown, v.from_env ? "EnvPlugin" : "Default",
               p->dflt, p->accepted);
    }
    fflush(stdout);
}
LB_ALIAS(ncclParamDumpAll)
#endif
