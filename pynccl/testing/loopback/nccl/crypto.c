/*
 * ncclSetEncryption (NCCL 2.32.3): the process's encryption of NCCL's TCP sockets.
 *
 * The loopback moves no bytes over sockets, so it records the setting as a digest that
 * each rank posts when it joins a world (world.c); ranks whose settings differ
 * are refused at init, as their TLS handshake would fail with NCCL.
 */
#include "internal.h"

#include <string.h>

#define LB_PSK_MIN 32

static uint64_t g_enc_hash; /* atomic; 0 = plaintext */

uint64_t lb_encryption_hash(void) { return __atomic_load_n(&g_enc_hash, __ATOMIC_ACQUIRE); }

#if LB_AT_LEAST(2, 32, 3)
ncclResult_t ncclSetEncryption(const ncclEncryptionConfig_t *config) {
    const char *opname = "ncclSetEncryption";
    if (config == NULL) return lb_err(ncclInvalidArgument, "%s : config argument is NULL", opname);
    ncclEncryptionConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    size_t n = config->size < sizeof cfg ? config->size : sizeof cfg;
    memcpy(&cfg, config, n);
    if (cfg.magic != NCCL_API_MAGIC)
        return lb_err(ncclInvalidArgument,
                      "%s : ncclEncryptionConfig_t argument not initialized via "
                      "NCCL_ENCRYPTION_CONFIG_INITIALIZER",
                      opname);
    if (cfg.mode == 0) { /* NCCL_ENCRYPTION_MODE_NONE */
        __atomic_store_n(&g_enc_hash, 0, __ATOMIC_RELEASE);
        return ncclSuccess;
    }
    if (cfg.mode != 1)
        return lb_err(ncclInvalidArgument, "%s : invalid encryption mode %d", opname, cfg.mode);
    if (cfg.psk == NULL || strlen(cfg.psk) < LB_PSK_MIN)
        return lb_err(ncclInvalidArgument, "%s : the pre-shared key must have at least %d characters",
                      opname, LB_PSK_MIN);
    uint64_t h = 0xcbf29ce484222325ULL ^ (uint64_t)cfg.mode;
    for (const unsigned char *p = (const unsigned char *)cfg.psk; *p; p++)
        h = (h ^ *p) * 0x100000001b3ULL;
    __atomic_store_n(&g_enc_hash, h ? h : 1, __ATOMIC_RELEASE);
    return ncclSuccess;
}
LB_ALIAS(ncclSetEncryption)
#endif
