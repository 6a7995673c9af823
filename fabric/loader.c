/* libfabric loaded when it is first used, not when the program starts.
 *
 * Linking libfabric pulls in its providers' libraries (libpsm_infinipath, libpsm2, verbs,
 * EFA, ...), and on Debian 12 libinfinipath's constructor installs handlers for SIGINT,
 * SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT that exit(1): a daemon asked to stop would
 * exit with a failure without its shutdown, and a Python interpreter importing kvpool would
 * lose Ctrl-C. So nothing links libfabric: the few functions of it that are not inline are
 * defined here (hidden, so they never stand in for libfabric's own), and the first call opens
 * the library with dlopen, keeping the process's signal handlers as they were before. */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>

#include <rdma/fabric.h>
#include <rdma/fi_errno.h>

#ifndef KVPOOL_LIBFABRIC_SO
#define KVPOOL_LIBFABRIC_SO "libfabric.so.1"
#endif

#define HIDDEN __attribute__((visibility("hidden")))

static int (*p_getinfo)(uint32_t, const char *, const char *, uint64_t,
                        const struct fi_info *, struct fi_info **);
static void (*p_freeinfo)(struct fi_info *);
static struct fi_info *(*p_dupinfo)(const struct fi_info *);
static int (*p_fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
static const char *(*p_strerror)(int);
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void *symbol(void *lib, const char *name, const char *version) {
    void *f = dlvsym(lib, name, version);
    return f ? f : dlsym(lib, name);
}

static void load(void) {
    static const int kept[] = {SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT};
    struct sigaction before[sizeof kept / sizeof kept[0]];
    for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++)
        sigaction(kept[i], NULL, &before[i]);
    void *lib = dlopen(KVPOOL_LIBFABRIC_SO, RTLD_NOW | RTLD_LOCAL);
    for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++)
        sigaction(kept[i], &before[i], NULL);
    if (!lib)
        return;
    p_strerror = symbol(lib, "fi_strerror", "FABRIC_1.0");
    p_fabric = symbol(lib, "fi_fabric", "FABRIC_1.1");
    p_getinfo = symbol(lib, "fi_getinfo", "FABRIC_1.3");
    p_freeinfo = symbol(lib, "fi_freeinfo", "FABRIC_1.3");
    p_dupinfo = symbol(lib, "fi_dupinfo", "FABRIC_1.3");
    if (!p_strerror || !p_fabric || !p_getinfo || !p_freeinfo || !p_dupinfo)
        p_getinfo = NULL;
}

/* Whether the library is loaded and has every function needed (loads it on first call). */
HIDDEN int kvpool_fabric_loaded(void) {
    pthread_once(&once, load);
    return p_getinfo != NULL;
}

HIDDEN int fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                      const struct fi_info *hints, struct fi_info **info) {
    if (!kvpool_fabric_loaded())
        return -FI_ENOSYS;
    return p_getinfo(version, node, service, flags, hints, info);
}

HIDDEN void fi_freeinfo(struct fi_info *info) {
    if (kvpool_fabric_loaded())
        p_freeinfo(info);
}

HIDDEN struct fi_info *fi_dupinfo(const struct fi_info *info) {
    if (!kvpool_fabric_loaded())
        return NULL;
    return p_dupinfo(info);
}

HIDDEN int fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context) {
    if (!kvpool_fabric_loaded())
        return -FI_ENOSYS;
    return p_fabric(attr, fabric, context);
}

HIDDEN const char *fi_strerror(int errnum) {
    if (!kvpool_fabric_loaded())
        return "libfabric is not installed (" KVPOOL_LIBFABRIC_SO ")";
    return p_strerror(errnum);
}
