/*
 * Stand-in libnvidia-ml.so.1 for lab hosts without a GPU.
 *
 * It answers the NVML calls the inference service makes (ironserve_service.gpu_health, gpu_guard through
 * gpu_health, exporter.read_gpus) from a plain-text state file, so the service's own pynvml code runs unchanged.
 * Every other NVML symbol is absent: pynvml reports a missing symbol as NVML_ERROR_FUNCTION_NOT_FOUND.
 *
 * ABI (function signatures, struct layouts, return codes and constants) as NVIDIA declares it in nvml.h,
 * read from NVIDIA/go-nvml gen/nvml/nvml.h (commit 314e96d0e80c8d21d5e52fd1a697ec2e46e11605) and checked against
 * the ctypes mirror in nvidia-ml-py 13.615.71 (pynvml.py: c_nvmlMemory_t, nvmlPciInfo_t, c_nvmlProcessInfo_v2_t,
 * c_nvmlEventData_t, NVML_ERROR_*). The versioned names (nvmlInit_v2, nvmlDeviceGetCount_v2,
 * nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetPciInfo_v3, nvmlDeviceGetComputeRunningProcesses_v3,
 * nvmlEventSetWait_v2) are the symbols pynvml resolves.
 *
 * The state file (IRONSERVE_NVML_STANDIN_STATE, default /etc/ironserve-lab/nvml-state; written by
 * ironserve_lab.standin_nvml) is re-read on every call, so a test can make a GPU sick and healthy again while the
 * exporter runs. Lines:
 *     count N                     GPUs NVML reports
 *     gpu INDEX KEY VALUE...      one field of one GPU (keys: see set_field); missing keys keep the A10 defaults
 *     xid ID INDEX CODE           an XID event, ID increasing; each event set delivers each ID once
 *     # ...                       comment
 * Numbers are read with strtoull base 0, so a mask may be written 0x4.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>

typedef int nvmlReturn_t; /* enum nvmlReturn_enum; an enum is int-sized in the C ABI */
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};
enum { NVML_FEATURE_DISABLED = 0, NVML_FEATURE_ENABLED = 1 }; /* nvmlEnableState_t */
enum { NVML_TEMPERATURE_GPU = 0 };                            /* nvmlTemperatureSensors_t */
enum { NVML_MEMORY_ERROR_TYPE_CORRECTED = 0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1 };
enum { NVML_VOLATILE_ECC = 0, NVML_AGGREGATE_ECC = 1 }; /* nvmlEccCounterType_t */
#define nvmlEventTypeXidCriticalError 0x0000000000000008ULL
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;

typedef struct nvmlMemory_st {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct nvmlUtilization_st {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct nvmlPciInfo_st {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

typedef struct nvmlProcessInfo_v2_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

typedef struct nvmlEventData_st {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

#define MAX_GPUS 16
#define MAX_PROCS 32
#define NO_INSTANCE 0xFFFFFFFFu /* gpuInstanceId / computeInstanceId without MIG */

struct gpu {
    char name[96], uuid[96], serial[30], bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned long long memory_total, memory_used;
    unsigned int utilization_gpu, utilization_memory;
    unsigned int power_mw, power_limit_mw, power_default_limit_mw, temperature_c;
    unsigned int pcie_gen, pcie_gen_max, pcie_width, pcie_width_max;
    unsigned int ecc_enabled;
    unsigned long long ecc[2][2]; /* [nvmlMemoryErrorType_t][nvmlEccCounterType_t] */
    unsigned int remapped_correctable, remapped_uncorrectable, remapped_pending, remapped_failure;
    unsigned long long throttle_mask;
    unsigned int lost, xid_events;
    unsigned int nprocs, proc_pid[MAX_PROCS];
    unsigned long long proc_bytes[MAX_PROCS];
};

struct state {
    unsigned int count;
    struct gpu gpus[MAX_GPUS];
};

/* Handles are addresses in this array, so the device in an event is the very pointer
 * nvmlDeviceGetHandleByIndex gave (gpu_health.XidWatcher maps events to GPUs by that address). */
struct nvmlDevice_st {
    unsigned int index;
};
static struct nvmlDevice_st devices[MAX_GPUS] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7},
                                                 {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}};

struct nvmlEventSet_st {
    unsigned long long registered[MAX_GPUS]; /* event type mask per GPU */
    unsigned long long delivered;            /* highest xid ID this set has seen */
};

/* NVML counts nvmlInit calls; the XID watcher's thread keeps its session while scrapes init and shut down. */
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int init_count;

static const char *state_path(void)
{
    const char *path = getenv("IRONSERVE_NVML_STANDIN_STATE");
    return path && *path ? path : "/etc/ironserve-lab/nvml-state";
}

/* Defaults: an idle A10 as service/tests/data/gpu_health/a10-nvidia-smi-q.txt captures it (driver 550.90.12);
 * memory from the lab's A10 hardware profile (23028 MiB). Identity is made up per index unless the file names it. */
static void a10_defaults(struct gpu *g, unsigned int index)
{
    memset(g, 0, sizeof(*g));
    snprintf(g->name, sizeof(g->name), "NVIDIA A10");
    snprintf(g->uuid, sizeof(g->uuid), "GPU-00000000-0000-0000-0000-%012u", index);
    snprintf(g->serial, sizeof(g->serial), "13252210%05u", index);
    snprintf(g->bus_id, sizeof(g->bus_id), "00000000:%02X:00.0", 0x3b + index);
    g->memory_total = 23028ULL << 20;
    g->power_mw = 15650;
    g->power_limit_mw = g->power_default_limit_mw = 150000;
    g->temperature_c = 33;
    g->pcie_gen = 1; /* an idle A10 drops its link to generation 1 */
    g->pcie_gen_max = 4;
    g->pcie_width = g->pcie_width_max = 16;
    g->ecc_enabled = 1;
    g->throttle_mask = 0x4; /* SW Power Cap */
    g->xid_events = 1;
}

static void copy_text(char *to, size_t size, const char *from)
{
    snprintf(to, size, "%s", from);
}

static void set_field(struct gpu *g, const char *key, const char *value)
{
    unsigned long long n = strtoull(value, NULL, 0);
    static const char *ecc_keys[2][2] = {{"ecc_volatile_corrected", "ecc_aggregate_corrected"},
                                         {"ecc_volatile_uncorrected", "ecc_aggregate_uncorrected"}};
    if (!strcmp(key, "name")) copy_text(g->name, sizeof(g->name), value);
    else if (!strcmp(key, "uuid")) copy_text(g->uuid, sizeof(g->uuid), value);
    else if (!strcmp(key, "serial")) copy_text(g->serial, sizeof(g->serial), value);
    else if (!strcmp(key, "pci_bus_id")) copy_text(g->bus_id, sizeof(g->bus_id), value);
    else if (!strcmp(key, "memory_total")) g->memory_total = n;
    else if (!strcmp(key, "memory_used")) g->memory_used = n;
    else if (!strcmp(key, "utilization_gpu")) g->utilization_gpu = (unsigned int)n;
    else if (!strcmp(key, "utilization_memory")) g->utilization_memory = (unsigned int)n;
    else if (!strcmp(key, "power_mw")) g->power_mw = (unsigned int)n;
    else if (!strcmp(key, "power_limit_mw")) g->power_limit_mw = (unsigned int)n;
    else if (!strcmp(key, "power_default_limit_mw")) g->power_default_limit_mw = (unsigned int)n;
    else if (!strcmp(key, "temperature_c")) g->temperature_c = (unsigned int)n;
    else if (!strcmp(key, "pcie_gen")) g->pcie_gen = (unsigned int)n;
    else if (!strcmp(key, "pcie_gen_max")) g->pcie_gen_max = (unsigned int)n;
    else if (!strcmp(key, "pcie_width")) g->pcie_width = (unsigned int)n;
    else if (!strcmp(key, "pcie_width_max")) g->pcie_width_max = (unsigned int)n;
    else if (!strcmp(key, "ecc_enabled")) g->ecc_enabled = (unsigned int)n;
    else if (!strcmp(key, "remapped_correctable")) g->remapped_correctable = (unsigned int)n;
    else if (!strcmp(key, "remapped_uncorrectable")) g->remapped_uncorrectable = (unsigned int)n;
    else if (!strcmp(key, "remapped_pending")) g->remapped_pending = (unsigned int)n;
    else if (!strcmp(key, "remapped_failure")) g->remapped_failure = (unsigned int)n;
    else if (!strcmp(key, "throttle_mask")) g->throttle_mask = n;
    else if (!strcmp(key, "lost")) g->lost = (unsigned int)n;
    else if (!strcmp(key, "xid_events")) g->xid_events = (unsigned int)n;
    else if (!strcmp(key, "processes")) { /* "PID:BYTES PID:BYTES ..." */
        const char *p = value;
        g->nprocs = 0;
        while (*p && g->nprocs < MAX_PROCS) {
            char *end;
            unsigned long pid = strtoul(p, &end, 10);
            if (end == p || *end != ':') break;
            g->proc_pid[g->nprocs] = (unsigned int)pid;
            g->proc_bytes[g->nprocs++] = strtoull(end + 1, &end, 0);
            p = end + strspn(end, " ");
        }
    } else {
        for (int t = 0; t < 2; t++)
            for (int c = 0; c < 2; c++)
                if (!strcmp(key, ecc_keys[t][c])) g->ecc[t][c] = n;
    }
}

/* Reads the whole file into *s; also the next xid event after `after` (ID 0 when none) and the highest xid ID.
 * Returns -1 when the file cannot be read (treated as the driver not being loaded). */
struct xid {
    unsigned long long id, index, code;
};
static int load(struct state *s, unsigned long long after, struct xid *next, unsigned long long *last)
{
    FILE *f = fopen(state_path(), "r");
    char line[512];
    if (!f) return -1;
    memset(s, 0, sizeof(*s));
    for (unsigned int i = 0; i < MAX_GPUS; i++) a10_defaults(&s->gpus[i], i);
    if (next) memset(next, 0, sizeof(*next));
    if (last) *last = 0;
    while (fgets(line, sizeof(line), f)) {
        char key[64];
        unsigned int index;
        int used = 0;
        struct xid x;
        line[strcspn(line, "\r\n")] = 0;
        if (sscanf(line, "count %u", &index) == 1) {
            s->count = index < MAX_GPUS ? index : MAX_GPUS;
        } else if (sscanf(line, "gpu %u %63s %n", &index, key, &used) == 2 && used > 0 && index < MAX_GPUS) {
            set_field(&s->gpus[index], key, line + used);
        } else if (sscanf(line, "xid %llu %llu %llu", &x.id, &x.index, &x.code) == 3) {
            if (last && x.id > *last) *last = x.id;
            if (next && x.id > after && (next->id == 0 || x.id < next->id)) *next = x;
        }
    }
    fclose(f);
    return 0;
}

static int initialised(void)
{
    pthread_mutex_lock(&init_lock);
    unsigned int n = init_count;
    pthread_mutex_unlock(&init_lock);
    return n > 0;
}

/* The common start of a device query: NVML started, a handle of ours to a GPU that exists, not lost. */
static nvmlReturn_t device_state(nvmlDevice_t device, struct state *s, struct gpu **g)
{
    if (!initialised()) return NVML_ERROR_UNINITIALIZED;
    if (device < devices || device >= devices + MAX_GPUS) return NVML_ERROR_INVALID_ARGUMENT;
    if (load(s, 0, NULL, NULL) < 0) return NVML_ERROR_UNKNOWN;
    if (device->index >= s->count) return NVML_ERROR_INVALID_ARGUMENT;
    *g = &s->gpus[device->index];
    return (*g)->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

/* Declares `s` and `g` and returns early on an error (or a NULL output pointer). */
#define DEVICE(device, out)                                    \
    struct state s;                                            \
    struct gpu *g;                                             \
    nvmlReturn_t rc = device_state(device, &s, &g);            \
    if (rc != NVML_SUCCESS) return rc;                         \
    if (!(out)) return NVML_ERROR_INVALID_ARGUMENT

static nvmlReturn_t copy_string(char *to, unsigned int length, const char *from)
{
    if (!to) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(from) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(to, from, strlen(from) + 1);
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    struct state s;
    (void)flags;
    /* No state file: this host has no (simulated) driver, as the real library answers without the kernel module. */
    if (load(&s, 0, NULL, NULL) < 0) return NVML_ERROR_DRIVER_NOT_LOADED;
    pthread_mutex_lock(&init_lock);
    init_count++;
    pthread_mutex_unlock(&init_lock);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&init_lock);
    if (init_count == 0) rc = NVML_ERROR_UNINITIALIZED;
    else init_count--;
    pthread_mutex_unlock(&init_lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    struct state s;
    if (!initialised()) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (load(&s, 0, NULL, NULL) < 0) return NVML_ERROR_UNKNOWN;
    *count = s.count;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

/* A lost GPU still has a handle; every query on it answers GPU_IS_LOST (as NVML does once a GPU falls off the bus
 * after it was enumerated). */
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    unsigned int count;
    nvmlReturn_t rc = nvmlDeviceGetCount_v2(&count);
    if (rc != NVML_SUCCESS) return rc;
    if (!device || index >= count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    DEVICE(device, name);
    return copy_string(name, length, g->name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    DEVICE(device, uuid);
    return copy_string(uuid, length, g->uuid);
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    DEVICE(device, serial);
    return copy_string(serial, length, g->serial);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    unsigned int slot = 0, function = 0;
    DEVICE(device, pci);
    memset(pci, 0, sizeof(*pci));
    copy_text(pci->busId, sizeof(pci->busId), g->bus_id);
    sscanf(g->bus_id, "%x:%x:%x.%x", &pci->domain, &pci->bus, &slot, &function);
    pci->device = slot;
    /* busIdLegacy is 16 bytes: the short "DDDD:BB:SS.F" form fits, the 8-digit domain would not. */
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.%X", pci->domain & 0xffff, pci->bus,
             slot, function);
    pci->pciDeviceId = 0x223610DE;    /* A10: device 0x2236, vendor 0x10DE (a10-nvidia-smi-q.txt "Device Id") */
    pci->pciSubSystemId = 0x148210DE; /* "Sub System Id" of the same capture */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    DEVICE(device, memory);
    memory->total = g->memory_total;
    memory->used = g->memory_used < g->memory_total ? g->memory_used : g->memory_total;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    DEVICE(device, utilization);
    utilization->gpu = g->utilization_gpu;
    utilization->memory = g->utilization_memory;
    return NVML_SUCCESS;
}

/* NVML's two-call protocol: a short (or NULL) array answers INSUFFICIENT_SIZE with the count needed. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos)
{
    DEVICE(device, count);
    unsigned int room = *count;
    *count = g->nprocs;
    if (g->nprocs == 0) return NVML_SUCCESS;
    if (!infos || room < g->nprocs) return NVML_ERROR_INSUFFICIENT_SIZE;
    for (unsigned int i = 0; i < g->nprocs; i++) {
        infos[i].pid = g->proc_pid[i];
        infos[i].usedGpuMemory = g->proc_bytes[i];
        infos[i].gpuInstanceId = infos[i].computeInstanceId = NO_INSTANCE;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, int *current, int *pending)
{
    DEVICE(device, current && pending);
    *current = *pending = g->ecc_enabled ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                         unsigned long long *count)
{
    DEVICE(device, count);
    if (errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->ecc_enabled) return NVML_ERROR_NOT_SUPPORTED; /* what NVML answers with ECC off */
    *count = g->ecc[errorType][counterType];
    return NVML_SUCCESS;
}

/* Ampere (the A10) remaps rows instead of retiring pages: NVML answers NOT_SUPPORTED, nvidia-smi prints N/A. */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause, unsigned int *count,
                                       unsigned long long *addresses)
{
    (void)cause;
    (void)addresses;
    DEVICE(device, count);
    return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *pending)
{
    DEVICE(device, pending);
    return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrected, unsigned int *uncorrected,
                                       unsigned int *pending, unsigned int *failure)
{
    DEVICE(device, corrected && uncorrected && pending && failure);
    *corrected = g->remapped_correctable;
    *uncorrected = g->remapped_uncorrectable;
    *pending = g->remapped_pending;
    *failure = g->remapped_failure;
    return NVML_SUCCESS;
}

/* R535 renamed "throttle reasons" to "clocks event reasons"; the same bitmask under both names. */
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    DEVICE(device, reasons);
    *reasons = g->throttle_mask;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

#define UINT_QUERY(function, field)                                \
    nvmlReturn_t function(nvmlDevice_t device, unsigned int *out) \
    {                                                              \
        DEVICE(device, out);                                       \
        *out = g->field;                                           \
        return NVML_SUCCESS;                                       \
    }
UINT_QUERY(nvmlDeviceGetPowerUsage, power_mw)
UINT_QUERY(nvmlDeviceGetEnforcedPowerLimit, power_limit_mw)
UINT_QUERY(nvmlDeviceGetPowerManagementDefaultLimit, power_default_limit_mw)
UINT_QUERY(nvmlDeviceGetCurrPcieLinkGeneration, pcie_gen)
UINT_QUERY(nvmlDeviceGetMaxPcieLinkGeneration, pcie_gen_max)
UINT_QUERY(nvmlDeviceGetCurrPcieLinkWidth, pcie_width)
UINT_QUERY(nvmlDeviceGetMaxPcieLinkWidth, pcie_width_max)

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temperature)
{
    DEVICE(device, temperature);
    if (sensor != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    *temperature = g->temperature_c;
    return NVML_SUCCESS;
}

/* Events. Like NVML, a set sees only events that happen after it was created: it starts at the highest xid ID
 * already in the file and delivers each later ID once (consume-once per set, so the exporter and the GPU guard
 * each see every XID, as two NVML clients would). */
nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    struct state s;
    unsigned long long last;
    if (!initialised()) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    if (load(&s, 0, NULL, &last) < 0) return NVML_ERROR_UNKNOWN;
    *set = calloc(1, sizeof(**set));
    if (!*set) return NVML_ERROR_UNKNOWN;
    (*set)->delivered = last;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set)
{
    DEVICE(device, set);
    /* Only XID events are simulated; asking for others is what NVML answers for an unsupported type. */
    if (!g->xid_events || (types & ~nvmlEventTypeXidCriticalError)) return NVML_ERROR_NOT_SUPPORTED;
    set->registered[device->index] |= types;
    return NVML_SUCCESS;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Polls the file every 20 ms until an event for a registered GPU arrives or `timeout_ms` passes (TIMEOUT). */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    double deadline = now_ms() + timeout_ms;
    if (!initialised()) return NVML_ERROR_UNINITIALIZED;
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    for (;;) {
        struct state s;
        struct xid next;
        if (load(&s, set->delivered, &next, NULL) < 0) return NVML_ERROR_UNKNOWN;
        if (next.id != 0) {
            set->delivered = next.id; /* consumed, delivered or not */
            if (next.index < s.count && (set->registered[next.index] & nvmlEventTypeXidCriticalError)) {
                data->device = &devices[next.index];
                data->eventType = nvmlEventTypeXidCriticalError;
                data->eventData = next.code;
                data->gpuInstanceId = data->computeInstanceId = NO_INSTANCE;
                return NVML_SUCCESS;
            }
            continue;
        }
        if (now_ms() >= deadline) return NVML_ERROR_TIMEOUT;
        struct timespec pause = {0, 20 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!initialised()) return NVML_ERROR_UNINITIALIZED;
    free(set);
    return NVML_SUCCESS;
}
