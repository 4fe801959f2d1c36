/*
 * Strict parsers for the PYNCCL_LOOPBACK_* environment variables, shared by the
 * loopback libcudart and libnccl: every call site reads its variable through one of
 * these, so a value means the same thing, and is refused the same way, everywhere.
 *
 * Rules: a variable that is not set takes its default; a set value must be exactly
 * what its kind allows, with no sign, spaces or suffix (an empty value is malformed):
 *   integer  decimal digits, at most `max`                  "0", "4096"
 *   boolean  0 or 1                                         "0"
 *   seconds  decimal digits with an optional fraction       "300", "0.5", ".25"
 *   count:code  an integer, optionally ':' and an integer   "2", "2:3" (code 1..max)
 * Each parser returns true and sets *out, or returns false, sets *out to the default
 * and writes into why[0..n) a sentence naming the variable, the value and what was
 * expected (the caller decides whether that is an error it can report).
 */
#ifndef PYNCCL_LB_ENV_H
#define PYNCCL_LB_ENV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Longest value quoted back in a message. */
#define LB_ENV_QUOTE 64
/* The bounds call sites and checks share: sizes, delays and other C ints; counts of
 * operations (LB_ENV_COUNT_CODE's count is bounded by LB_ENV_MAX_COUNT). */
#define LB_ENV_MAX_INT 2147483647ULL
#define LB_ENV_MAX_COUNT (1ULL << 62)

static inline bool lb_env_bad(const char *name, const char *value, const char *expect, char *why,
                              size_t n) {
    if (why != NULL && n > 0)
        snprintf(why, n, "%s='%.*s' is malformed: expected %s", name, LB_ENV_QUOTE, value, expect);
    return false;
}

/* Decimal digits at *text (at least one), at most max; *end is set past them. */
static inline bool lb_parse_digits(const char *text, unsigned long long max,
                                   unsigned long long *out, const char **end) {
    unsigned long long v = 0;
    const char *p = text;
    for (; *p >= '0' && *p <= '9'; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (d > max || v > (max - d) / 10) return false; /* v * 10 + d > max */
        v = v * 10 + d;
    }
    *end = p;
    if (p == text) return false;
    *out = v;
    return true;
}

static inline bool lb_env_uint(const char *name, unsigned long long dflt, unsigned long long max,
                               unsigned long long *out, char *why, size_t n) {
    *out = dflt;
    const char *text = getenv(name);
    if (text == NULL) return true;
    unsigned long long v;
    const char *end;
    if (!lb_parse_digits(text, max, &v, &end) || *end != '\0') {
        char expect[80];
        snprintf(expect, sizeof expect, "an integer in [0, %llu]", max);
        return lb_env_bad(name, text, expect, why, n);
    }
    *out = v;
    return true;
}

static inline bool lb_env_bool(const char *name, bool dflt, bool *out, char *why, size_t n) {
    *out = dflt;
    const char *text = getenv(name);
    if (text == NULL) return true;
    if ((text[0] != '0' && text[0] != '1') || text[1] != '\0')
        return lb_env_bad(name, text, "0 or 1", why, n);
    *out = text[0] == '1';
    return true;
}

/* A duration: "300", "0.5", ".25" (up to 10^9 s, resolution 1 ns). */
static inline bool lb_env_seconds(const char *name, double dflt, double *out, char *why,
                                  size_t n) {
    *out = dflt;
    const char *text = getenv(name);
    if (text == NULL) return true;
    const char *expect = "a number of seconds >= 0, such as 300 or 0.5";
    unsigned long long whole = 0, frac = 0;
    const char *p = text, *end = text;
    bool digits = lb_parse_digits(p, 1000000000ULL, &whole, &end); /* false: none, or too many */
    p = end;
    double scale = 1;
    if (*p == '.') {
        const char *q = ++p;
        for (; *q >= '0' && *q <= '9'; q++)
            if (q - p < 9) {
                frac = frac * 10 + (unsigned)(*q - '0');
                scale *= 10;
            }
        digits = digits || q > p;
        p = q;
    }
    if (!digits || *p != '\0') return lb_env_bad(name, text, expect, why, n);
    *out = (double)whole + (double)frac / scale;
    return true;
}

/* "<count>[:<code>]": count <= max_count; code in [1, max_code], default dflt_code. */
static inline bool lb_env_count_code(const char *name, unsigned long long max_count,
                                     int max_code, bool *set, unsigned long long *count,
                                     int *code, int dflt_code, char *why, size_t n) {
    *set = false;
    *count = 0;
    *code = dflt_code;
    const char *text = getenv(name);
    if (text == NULL) return true;
    char expect[96];
    snprintf(expect, sizeof expect, "<count>[:<code>], a count in [0, %llu] and a code in [1, %d]",
             max_count, max_code);
    unsigned long long v, c = (unsigned long long)dflt_code;
    const char *end;
    if (!lb_parse_digits(text, max_count, &v, &end)) return lb_env_bad(name, text, expect, why, n);
    if (*end == ':' && (!lb_parse_digits(end + 1, (unsigned long long)max_code, &c, &end) || c < 1))
        return lb_env_bad(name, text, expect, why, n);
    if (*end != '\0') return lb_env_bad(name, text, expect, why, n);
    *set = true;
    *count = v;
    *code = (int)c;
    return true;
}

/* The longest directory LB_ENV_DIR accepts: a unix socket path in it must fit in 108 bytes. */
#define LB_ENV_MAX_DIR 40

/* An existing directory, by an absolute path of at most LB_ENV_MAX_DIR characters; *out is
 * NULL when the variable is unset. */
static inline bool lb_env_dir(const char *name, const char **out, char *why, size_t n) {
    const char *v = getenv(name);
    struct stat st;
    *out = NULL;
    if (!v) return true;
    if (v[0] != '/' || strlen(v) > LB_ENV_MAX_DIR || stat(v, &st) != 0 || !S_ISDIR(st.st_mode))
        return lb_env_bad(name, v, "an existing directory by an absolute path of at most 40 "
                          "characters", why, n);
    *out = v;
    return true;
}

/* One library's variables, checked together (at load, or when a communicator is made). */
enum lb_env_kind { LB_ENV_UINT, LB_ENV_BOOL, LB_ENV_SECONDS, LB_ENV_COUNT_CODE, LB_ENV_DIR };

typedef struct {
    const char *name;
    enum lb_env_kind kind;
    unsigned long long max; /* LB_ENV_UINT: the largest value; LB_ENV_COUNT_CODE: the code's */
} lb_env_spec;

/* true if every variable of specs[0..nspecs) is unset or well formed; else false with
 * why set for the first that is not. */
static inline bool lb_env_check(const lb_env_spec *specs, size_t nspecs, char *why, size_t n) {
    for (size_t i = 0; i < nspecs; i++) {
        const lb_env_spec *s = &specs[i];
        unsigned long long u;
        bool b, set;
        double d;
        int code;
        const char *path;
        bool ok = true;
        switch (s->kind) {
        case LB_ENV_UINT: ok = lb_env_uint(s->name, 0, s->max, &u, why, n); break;
        case LB_ENV_BOOL: ok = lb_env_bool(s->name, false, &b, why, n); break;
        case LB_ENV_SECONDS: ok = lb_env_seconds(s->name, 0, &d, why, n); break;
        case LB_ENV_COUNT_CODE:
            ok = lb_env_count_code(s->name, LB_ENV_MAX_COUNT, (int)s->max, &set, &u, &code, 1,
                                   why, n);
            break;
        case LB_ENV_DIR: ok = lb_env_dir(s->name, &path, why, n); break;
        }
        if (!ok) return false;
    }
    return true;
}

#endif /* PYNCCL_LB_ENV_H */
