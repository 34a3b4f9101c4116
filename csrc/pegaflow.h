/*
 * pegaflow.h — the whole C ABI of libpegaflow.so.
 *
 * libpegaflow is mechanism only: it maps memory, moves bytes and reports
 * completions. Every decision (what to save, where, what to evict, which copy
 * path) is made by the TypeScript layer above and passed in.
 *
 * Conventions (read these once; every function follows them):
 *  - Every function returns int32_t: >= 0 is success (some return a count or
 *    an id), < 0 is a PF_E* code. The human-readable reason of the last
 *    failure on the calling thread is copied out by pf_last_error().
 *  - Objects are named by u32 handles, never by raw pointers, so that a stale
 *    or forged handle is rejected (PF_EHANDLE) instead of dereferenced.
 *    A handle encodes (generation << 16 | slot); 0 is never valid.
 *  - Every data-moving entry point takes a batch. There is no per-block call.
 *  - Memory passed in is borrowed for the duration of the call only, unless a
 *    function says otherwise. Memory returned (pf_*_ptr) is owned by the
 *    library and stays valid until the owning handle is destroyed.
 *  - u64 values cross FFI as BigInt in Deno ("u64"/"usize"); sizes and
 *    offsets are always u64.
 */
#ifndef PEGAFLOW_H
#define PEGAFLOW_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PF_ABI_VERSION 10

/* ---- status codes ------------------------------------------------------ */
enum pf_status {
  PF_OK = 0,
  PF_EINVAL = -1,     /* malformed argument (size, alignment, enum value) */
  PF_EHANDLE = -2,    /* unknown, stale or wrong-kind handle */
  PF_ERANGE = -3,     /* a segment falls outside its region or the pool */
  PF_ENOMEM = -4,     /* host or device allocation failed */
  PF_ENODEV = -5,     /* backend unavailable (no libcuda, no GPU, no path) */
  PF_EBUSY = -6,      /* object still referenced by in-flight work */
  PF_ECUDA = -7,      /* a CUDA driver call failed (message has the name) */
  PF_EIO = -8,        /* an OS / io_uring call failed (message has errno) */
  PF_ESHUTDOWN = -9,  /* the object is shutting down; no new work */
  PF_ETIMEDOUT = -10, /* a wait ran out of time (not an error for waits) */
  PF_EUNSUPPORTED = -11, /* feature absent in this build or driver */
  PF_EOVERFLOW = -12, /* completion ring or queue full */
  /* A client's shared memory faulted under an access (SIGBUS: the client
   * shrank the file behind a host region or a load-state block after it was
   * mapped). Only that client's batch or call fails; see pf_guard. */
  PF_EFAULT = -13,
  /* Not done because an earlier group of the same batch failed (LAYER
   * records after a failed group; progress words never pass a failure). */
  PF_ECANCELED = -14,
};

/* Copies the calling thread's last error message (NUL-terminated, truncated
 * to cap) into buf. Returns the full message length. */
int32_t pf_last_error(char *buf, uint32_t cap);
/* ABI version this library implements (PF_ABI_VERSION). */
int32_t pf_abi_version(void);

/* ---- engine (one per backend device) ----------------------------------- */
enum pf_backend { PF_BACKEND_AUTO = 0, PF_BACKEND_CUDA = 1, PF_BACKEND_HOST = 2 };

/* Kernel variants of the copy kernel (env PEGAFLOW_KERNEL=simt|tma at open). */
enum pf_kernel_variant {
  PF_KERNEL_SIMT = 0, /* 16-byte vector loads/stores */
  PF_KERNEL_TMA = 1,  /* Hopper bulk copy (cp.async.bulk) */
};

/* Opens an engine on device `device` (ignored by the host backend).
 * AUTO picks CUDA when libcuda.so.1 loads and a device exists, else HOST.
 * `workers`: host-backend copy threads (0 = library default). */
int32_t pf_engine_open(int32_t backend, int32_t device, uint32_t workers,
                       uint32_t *out_engine);
/*
 * What pf_engine_info reports (104 bytes, every field at a fixed offset):
 *
 *   offset 0   u32 backend         4  i32 device        8  u32 abi_version
 *   offset 12  u32 driver_version 16  u32 sm_count     20  u32 kernel_grid
 *   offset 24  u32 kernel_variant 28  u8 has_kernel, has_dma_batch, has_ipc,
 *                                     reserved
 *   offset 32  u64 device_mem_bytes
 *   offset 40  char device_name[64]
 *
 * device_name + driver_version name the hardware a calibration table was
 * measured on (the caller caches tables keyed by them).
 */
#define PF_DEVICE_NAME_BYTES 64u
typedef struct pf_engine_props {
  uint32_t backend;        /* pf_backend running: CUDA or HOST, never AUTO */
  int32_t device;          /* device ordinal (0 on host) */
  uint32_t abi_version;    /* PF_ABI_VERSION */
  uint32_t driver_version; /* cuDriverGetVersion (12080 = 12.8); 0 on host */
  uint32_t sm_count;       /* 0 on host */
  uint32_t kernel_grid;    /* blocks the kernel path launches now; 0 on host */
  uint32_t kernel_variant; /* pf_kernel_variant */
  uint8_t has_kernel;      /* 1: gather/scatter kernel loaded */
  uint8_t has_dma_batch;   /* 1: cuMemcpyBatchAsync available */
  uint8_t has_ipc;         /* 1: CUDA IPC import/export */
  uint8_t reserved;
  uint64_t device_mem_bytes; /* total device memory; 0 on host */
  /* cuDeviceGetName ("NVIDIA H100 80GB HBM3"), NUL-terminated; "host" on
   * the host backend. */
  char device_name[PF_DEVICE_NAME_BYTES];
} pf_engine_props;
int32_t pf_engine_info(uint32_t engine, pf_engine_props *out);
/* Sets the kernel path's grid size (blocks); 0 restores the default.
 * Small grids leave SMs to the model (the kernel competes with decode). */
int32_t pf_engine_set_kernel_grid(uint32_t engine, uint32_t blocks);
/* Sets the copy engines' share of PF_PATH_MIXED batches, in permille of
 * each group's bytes (0..1000); 0 restores the default. */
int32_t pf_engine_set_dma_share(uint32_t engine, uint32_t permille);
/* Fails with PF_EBUSY while pools/regions of this engine are alive. */
int32_t pf_engine_close(uint32_t engine);
/* Marks the engine's device failed, as a lost device would be (a test hook
 * on both backends; the cuda backend also sets it itself when a copy meets
 * an error that leaves the context unusable: illegal address, launch
 * failure, ECC, a destroyed context). From then on every batch this engine
 * runs fails with `code` (a negative PF_E*; PF_EIO if 0 or positive) and a
 * text naming the engine's device; other engines (devices) are untouched.
 * Not reversible. */
int32_t pf_engine_fail(uint32_t engine, int32_t code);

/* Devices a backend can open: cuda = cuDeviceGetCount (PF_ENODEV without a
 * driver); host = 0 (no physical devices: every id is a name the caller
 * picks); AUTO = cuda's count where a driver and a device exist, else 0. */
int32_t pf_device_count(int32_t backend, uint32_t *out_count);
/* The NUMA node a device is attached to: cuda reads
 * /sys/bus/pci/devices/<cuDeviceGetPCIBusId>/numa_node; -1 where the
 * platform does not say (one node, or a VM) and always on the host backend
 * (the caller maps host devices itself). */
int32_t pf_device_numa_node(int32_t backend, int32_t device, int32_t *out_node);

/* ---- completion ring --------------------------------------------------- */
/*
 * A single-consumer, multi-producer ring of fixed 32-byte records in memory
 * the consumer (JS) reads through a typed array at pf_ring_ptr():
 *
 *   offset 0   u64 head      written by producers: records [0, head) exist
 *   offset 8   u64 tail      written by the consumer: records [0, tail) read
 *   offset 16  u32 capacity  power of two
 *   offset 20  u32 shutdown  non-zero once pf_ring_shutdown was called
 *   offset 24  u64 reserved
 *   offset 64  pf_completion records[capacity]   (record i at i % capacity)
 *
 * Producers never overwrite unread records: when head - tail == capacity a
 * producer waits until the consumer advances tail (backpressure into the
 * worker threads, never data loss). The consumer calls pf_ring_wait() —
 * declared nonblocking in Deno so it runs off the JS thread — to sleep until
 * head moves past what it has seen.
 */
typedef struct pf_completion {
  uint64_t tag;    /* the caller's tag given at submit */
  uint32_t kind;   /* pf_completion_kind */
  uint32_t index;  /* layer-group index (LAYER) or op index (IO) */
  int32_t status;  /* PF_OK or a PF_E* code */
  uint32_t aux;    /* LAYER: the group's layer id; BATCH: the batch's pf_path */
  uint64_t value;  /* LAYER/IO: bytes moved; BATCH: ns from submit to end */
} pf_completion;

enum pf_completion_kind {
  PF_DONE_LAYER = 1, /* one layer group of a copy batch finished */
  PF_DONE_BATCH = 2, /* the whole copy batch finished (always last) */
  PF_DONE_IO = 3,    /* one io_uring op finished */
  PF_DONE_IO_BATCH = 4, /* a whole io batch finished (always last) */
};

#define PF_RING_HEADER_BYTES 64u

int32_t pf_ring_create(uint32_t capacity, uint32_t *out_ring);
/* Address of the ring memory (header + records). Valid until destroy. */
void *pf_ring_ptr(uint32_t ring);
/* Blocks until head > seen, shutdown, or timeout_ms (< 0: forever).
 * Returns the current head as a non-negative i64, or PF_ESHUTDOWN once the
 * ring is shut down and fully drained past `seen`, or PF_ETIMEDOUT. */
int64_t pf_ring_wait(uint32_t ring, uint64_t seen, int32_t timeout_ms);
/* Copies the failure text of the batch that posted its BATCH record with
 * `tag` on this ring into buf (NUL-terminated, truncated to cap) and forgets
 * it. The library keeps the text of the last PF_RING_ERRORS failed batches
 * per ring, recorded before their BATCH record is posted; it names what C
 * knows (group, layer, region handle and shm name, offset, expected vs got).
 * Returns the text's full length, or 0 when none is kept for the tag. */
#define PF_RING_ERRORS 32u
int32_t pf_ring_take_error(uint32_t ring, uint64_t tag, char *buf,
                           uint32_t cap);
/* Wakes every waiter and every blocked producer; later submits that would
 * post to this ring fail with PF_ESHUTDOWN. Idempotent. */
int32_t pf_ring_shutdown(uint32_t ring);
/* Fails with PF_EBUSY while work that posts to the ring is in flight. */
int32_t pf_ring_destroy(uint32_t ring);

/* ---- pinned host pool -------------------------------------------------- */
enum pf_pool_flags {
  PF_POOL_HUGEPAGES = 1u << 0, /* mmap(MAP_HUGETLB); clear error if none */
  PF_POOL_PRETOUCH = 1u << 1,  /* fault every page in, in parallel */
};
/* Allocates one region of `bytes` host memory, page-locked and mapped for
 * the device (CUDA: cuMemHostAlloc DEVICEMAP, or mmap + cuMemHostRegister
 * for huge pages; host: mmap + mlock where permitted).
 *
 * Creating a pool of tens of GiB takes seconds (pre-touch, page-locking).
 * `progress` (optional, NULL for none) is caller memory the library updates
 * while it works, so a caller that runs this call off its main thread (Deno:
 * a nonblocking symbol) can report progress on a timer. It must stay valid
 * until the call returns. */
enum pf_pool_phase {
  PF_POOL_PHASE_MAP = 0,   /* reserving the mapping */
  PF_POOL_PHASE_TOUCH = 1, /* pre-touching; touched_bytes counts up */
  PF_POOL_PHASE_LOCK = 2,  /* page-locking (mlock / cuMemHostRegister) */
  PF_POOL_PHASE_DONE = 3,
};
typedef struct pf_pool_progress {
  uint64_t touched_bytes; /* bytes pre-touched so far (relaxed, monotone) */
  uint32_t phase;         /* pf_pool_phase (relaxed) */
  uint32_t reserved;
  /* On failure, the error text (NUL-terminated): the caller's thread is not
   * the one pf_last_error would answer on. */
  char error[256];
} pf_pool_progress;
int32_t pf_pool_create(uint32_t engine, uint64_t bytes, uint32_t flags,
                       uint32_t touch_threads, pf_pool_progress *progress,
                       uint32_t *out_pool);
/* One part of a pool split across NUMA nodes (16 bytes). */
typedef struct pf_pool_part {
  uint64_t bytes; /* offset 0: a multiple of the mapping's page size, except the last part's */
  int32_t node;   /* offset 8: NUMA node its pages are bound to; -1 = not bound */
  uint32_t reserved; /* offset 12: 0 */
} pf_pool_part;
/* pf_pool_create with the mapping cut into `nparts` consecutive parts
 * (their bytes sum to `bytes`); each part's pages are bound to its node
 * (mbind MPOL_BIND, before pre-touch, so the pages are faulted in there).
 * One pool, one handle, one registration (portable: every device's engine
 * copies through it); the caller decides which part a device's copies use.
 * nparts == 0 is pf_pool_create. A node the kernel does not have fails
 * with PF_EINVAL naming the part and node. */
#define PF_POOL_PARTS_MAX 64u
int32_t pf_pool_create_split(uint32_t engine, uint64_t bytes, uint32_t flags,
                             uint32_t touch_threads, pf_pool_progress *progress,
                             const pf_pool_part *parts, uint32_t nparts,
                             uint32_t *out_pool);
void *pf_pool_ptr(uint32_t pool);
/* What pf_pool_info reports (32 bytes): what was applied, and timing. */
typedef struct pf_pool_props {
  uint64_t bytes;           /* offset 0: size asked for */
  uint64_t alloc_ns;        /* offset 8: allocating + pre-touching + locking */
  uint64_t huge_page_bytes; /* offset 16: huge page size used, 0 if none */
  uint8_t hugepages;        /* offset 24: 1: backed by huge pages */
  uint8_t pretouched;       /* offset 25: 1: every page faulted in */
  /* offset 26: 1: page-locked (cuda: registered with the driver; host:
   * mlock succeeded). */
  uint8_t locked;
  uint8_t reserved[5];
} pf_pool_props;
int32_t pf_pool_info(uint32_t pool, pf_pool_props *out);
int32_t pf_pool_destroy(uint32_t pool); /* PF_EBUSY while copies in flight */

/* ---- regions: a client's KV memory ------------------------------------- */
/*
 * A 64-byte handle names a region across processes:
 *  - cuda: the CUipcMemHandle of a cuMemAlloc'd allocation;
 *  - host: a NUL-terminated shared-memory name ("/pegaflow-..."), a file in
 *    /dev/shm, zero-padded.
 */
#define PF_HANDLE_BYTES 64u

/* Exporting side (engines, tests, benchmarks acting as an engine): allocates
 * `bytes` of device memory (host backend: a shm file) and writes its handle. */
int32_t pf_region_alloc(uint32_t engine, uint64_t bytes, uint8_t *out_handle,
                        uint32_t *out_region);
/* Importing side (the server): opens a peer's handle; `bytes` is the size
 * the peer declared and is checked against the real allocation. */
int32_t pf_region_import(uint32_t engine, const uint8_t *handle, uint64_t bytes,
                         uint32_t *out_region);
/* What pf_region_info reports (24 bytes). */
typedef struct pf_region_props {
  uint64_t bytes;    /* offset 0 */
  uint64_t addr;     /* offset 8: device address (cuda) or host address */
  uint32_t imported; /* offset 16: 1 if imported, 0 if allocated here */
  uint32_t inflight; /* offset 20: layer groups in flight that touch it */
} pf_region_props;
int32_t pf_region_info(uint32_t region, pf_region_props *out);
/* Synchronous host<->region byte access for clients and tests (never on the
 * server's hot path). */
int32_t pf_region_write(uint32_t region, uint64_t offset, const void *src,
                        uint64_t bytes);
int32_t pf_region_read(uint32_t region, uint64_t offset, void *dst,
                       uint64_t bytes);
/* Closes the mapping (import) or frees the memory (alloc); an allocated shm
 * region also unlinks its name. PF_EBUSY while copies are in flight: the
 * caller drains first (unmapping under a queued copy corrupts memory). */
int32_t pf_region_close(uint32_t region);

/* ---- batch copy -------------------------------------------------------- */
enum pf_direction { PF_D2H = 0 /* gather: region -> pool */,
                    PF_H2D = 1 /* scatter: pool -> region */ };
/*
 * The copy path is the caller's choice, per batch: the library never picks
 * or substitutes one (the policy, calibrated at start-up, lives in
 * lib/copy_path.ts). A path the engine lacks fails the submit with
 * PF_EUNSUPPORTED. The host backend has one way to copy (memcpy on its
 * workers): it accepts every path, ignores it, and reports it back.
 */
enum pf_path {
  /* The host backend's memcpy. The cuda backend refuses it (PF_EINVAL):
   * a batch that names no GPU path is a caller bug, not a hint. */
  PF_PATH_HOST = 0,
  PF_PATH_KERNEL = 1, /* gather/scatter kernel over mapped pinned memory */
  PF_PATH_DMA_BATCH = 2, /* cuMemcpyBatchAsync, issued by several threads */
  PF_PATH_DMA = 3,    /* one cuMemcpyAsync per segment, same threads */
  /* Kernel and copy engines at once: each group's ranges are split by
   * bytes, a share (pf_engine_set_dma_share) to the copy engines (batch DMA
   * where available) on a second stream, the rest to the kernel. Neither
   * alone fills the link with 32 KB segments; together they do. */
  PF_PATH_MIXED = 4,
};

/*
 * A batch descriptor lives in one caller-owned buffer (reused across
 * submits; the library copies what it needs before pf_copy_submit returns):
 *
 *   pf_batch_header                          (32 bytes)
 *   pf_batch_group  groups[num_groups]       (16 bytes each, at offset 32)
 *   pf_batch_seg    segs[num_segs]           (24 bytes each, at segs_off)
 *
 * Group g covers segs[first_seg, first_seg + num_segs) and completes with one
 * PF_DONE_LAYER record (index = g) once all its segments have landed; the
 * batch completes with one PF_DONE_BATCH record after every group. Groups
 * complete in order. Offsets are relative to the group's region and to the
 * pool, so every segment is bounds-checked before anything is copied: a
 * batch with one bad segment copies nothing and fails with PF_ERANGE.
 * Each segment is copied as given: the library does not merge contiguous
 * segments (the caller merges once, while it builds the batch:
 * lib/transfer/ranges.ts), so a segment is the unit the copy path sees.
 *
 * Client memory (a host region, the progress shm) is touched only under a
 * SIGBUS guard: if the client shrinks the file behind it, the group fails
 * with PF_EFAULT, every later group with PF_ECANCELED, the BATCH record
 * carries PF_EFAULT and pf_ring_take_error gives the text naming the region
 * or shm and the offset. The process and other batches are unaffected.
 */
typedef struct pf_batch_header {
  uint32_t num_groups;
  uint32_t num_segs;
  uint32_t direction; /* pf_direction */
  uint32_t path;      /* pf_path */
  /* Optional progress words (0 = none): a pf_shm handle and a byte offset
   * (8-aligned) in it. As group g completes, the library stores g + 1 into
   * the u32 at progress_off (release order, after the bytes landed), and
   * once the batch ends, 1 (ok) or the negative PF_E* code into the i32 at
   * progress_off + 4. While the batch runs the count is a prefix: it never
   * passes a failed group. A failed batch then stores num_groups into the
   * u32 after its state, so a waiter on the counter alone never hangs. An
   * engine polls these words with no RPC: this is how layer-wise load
   * reaches the model without a JS hop. */
  uint32_t progress_shm;
  uint32_t progress_off;
  /* Byte offset of segs[] from the start of the descriptor (8-aligned), or
   * 0 for "right after groups[num_groups]". Lets a caller preallocate room
   * for G groups and write segments before it knows how many groups the
   * batch will have. */
  uint32_t segs_off;
  uint32_t flags; /* PF_BATCH_* bits; any other bit is refused */
} pf_batch_header;

/* The consumer reads the batch only once all of it has landed (an engine's
 * async load), never group by group: a cuda engine may then spread an H2D
 * batch over several copy lanes, as it does a D2H one. Its groups still
 * complete (and count in the progress words) in order, but in bursts; a
 * layer-wise load leaves this off, so its layers land one after another. */
#define PF_BATCH_WHOLE 1u
/* No PF_DONE_LAYER records: the batch posts its PF_DONE_BATCH record only
 * (progress words are still stored group by group). For a consumer that
 * awaits only the batch's end (a server's save, a load whose engine watches
 * the progress words): one ring record and one reader wake per batch
 * instead of num_groups + 1. A failed group's text still reaches
 * pf_ring_take_error through the BATCH record. The cuda backend issues a
 * quiet batch without progress words on the copy engines (DMA, DMA_BATCH)
 * whole: one copy call per lane slice and one event per stream, not one
 * per group, its groups all done once it landed. */
#define PF_BATCH_QUIET 2u

typedef struct pf_batch_group {
  uint32_t region;    /* region handle (imported or allocated) */
  uint32_t layer;     /* caller's layer id: in errors and LAYER records */
  uint32_t first_seg;
  uint32_t num_segs;
} pf_batch_group;

typedef struct pf_batch_seg {
  uint64_t region_off; /* byte offset in the group's region */
  uint64_t pool_off;   /* byte offset in the pool */
  uint64_t bytes;      /* > 0 */
} pf_batch_seg;

/* Submits a batch; returns 0 once queued. The copy runs on the engine's
 * stream (cuda) or worker threads (host); completions go to `ring` with
 * `tag`. The ring must have room for num_groups + 1 records eventually
 * (1 for a PF_BATCH_QUIET batch). */
int32_t pf_copy_submit(uint32_t engine, uint32_t pool, uint32_t ring,
                       const void *desc, uint64_t desc_bytes, uint64_t tag);

/* Measures each available path on this engine in `direction` for segment
 * sizes sizes[0..n) (bytes), moving total_bytes per point, and writes GB/s
 * into out_gbps[p * n + i] (5 * n doubles) for p = the pf_path value:
 * row 0 (PF_PATH_HOST) holds one large contiguous copy (the link's peak,
 * same for every i), then KERNEL, DMA_BATCH, DMA, MIXED (0 where a path is
 * absent or the driver refused it; the host backend fills DMA's row with
 * its memcpy). Each figure is the best of 3 timed batches after
 * a warm-up, submit to last byte. Segments sit at a stride of twice their
 * size on the device side so that nothing merges. Uses scratch device
 * memory (host: an anonymous mapping) and pool bytes [0, total_bytes);
 * synchronous; fails with PF_EBUSY while batches use the pool. */
int32_t pf_calibrate(uint32_t engine, uint32_t pool, uint32_t direction,
                     const uint64_t *sizes, uint32_t n, uint64_t total_bytes,
                     double *out_gbps);

/* ---- shared memory ---------------------------------------------------- */
enum pf_shm_flags {
  PF_SHM_CREATE = 1u << 0, /* create (exclusive) and size the object */
  PF_SHM_UNLINK = 1u << 1, /* unlink the name when closed */
};
/* Maps the POSIX shm object `name` ("/..."), `bytes` long, read-write. Used
 * for load-state words and other small control blocks shared with engines.
 * Opening checks the object is at least `bytes` long. */
int32_t pf_shm_open(const char *name, uint64_t bytes, uint32_t flags,
                    uint32_t *out_shm);
/* The mapping, for the process that owns the object (an engine polling its
 * own load state). A process mapping a PEER's object (the server) must not
 * touch it directly: the peer can shrink it at any time; use the guarded
 * pf_shm_read / pf_shm_write instead. */
void *pf_shm_ptr(uint32_t shm);
/* 1 while the name `shm` was opened by still names the object it maps, at
 * least as long as the mapping (one stat: a process keeping a peer's mapping
 * for reuse checks it before each use); 0 once the name was unlinked,
 * recreated or the object shrunk; PF_EHANDLE for a bad handle. */
int32_t pf_shm_same(uint32_t shm);
/* Guarded byte access to a mapped shm object: [offset, offset + bytes) must
 * lie inside the mapping (PF_ERANGE). When offset and bytes are 4-aligned the
 * bytes move as whole u32 words (acquire loads / release stores), so a peer
 * polling a word never sees it torn. A peer that shrank the object below the
 * range makes the call fail with PF_EFAULT, naming the shm and offset,
 * instead of killing the process. */
int32_t pf_shm_read(uint32_t shm, uint64_t offset, void *dst, uint64_t bytes);
int32_t pf_shm_write(uint32_t shm, uint64_t offset, const void *src,
                     uint64_t bytes);
int32_t pf_shm_close(uint32_t shm); /* PF_EBUSY while a batch reports to it */

/* ---- io_uring (SSD tier) ----------------------------------------------- */
/*
 * One io_uring instance per SSD tier, driven by one reaper thread that posts
 * completions to the same ring as the copy engine. An op moves one record:
 * an optional 4 KiB header page (in a staging arena the library owns and JS
 * reads/writes through a typed array) followed by the op's pool extents, so a
 * record is one readv/writev and the payload never takes an extra copy.
 *
 * Alignment is handled inside: an op whose file offset, lengths or pool
 * addresses do not meet the file's O_DIRECT alignment (statx DIOALIGN, else
 * the device's logical block size) goes through a second, buffered
 * descriptor of the same file instead of failing with EINVAL.
 */
enum pf_io_op { PF_IO_READ = 0 /* file -> pool */, PF_IO_WRITE = 1 /* pool -> file */ };
enum pf_io_flags {
  /* read: after the data landed, CRC32C of the op's pool extents (header
   * excluded) is computed on the reaper thread and reported in `aux`. */
  PF_IO_CRC = 1u << 0,
};
enum pf_file_flags {
  PF_FILE_DIRECT = 1u << 0, /* O_DIRECT (falls back to buffered where the
                               filesystem refuses it; see pf_file_info) */
  PF_FILE_CREATE = 1u << 1, /* O_CREAT, mode 0644 */
  PF_FILE_RDONLY = 1u << 2,
};
/* Size of one header staging page and of the on-disk header it becomes. */
#define PF_IO_HDR_BYTES 4096u

/* Opens an io_uring of `depth` entries (power of two, 1..4096) over `pool`,
 * posting completions to `ring`, with `hdr_pages` staging pages of
 * PF_IO_HDR_BYTES each (0..65536). The pool (in 1 GiB pieces) and the
 * staging arena are registered as fixed buffers and files as fixed files
 * where the kernel allows (see pf_uring_info). At most `depth` ops are in the
 * kernel at once; the rest of a batch waits inside the library. */
int32_t pf_uring_open(uint32_t pool, uint32_t ring, uint32_t depth,
                      uint32_t hdr_pages, uint32_t *out_uring);
/* Address of the header staging arena (hdr_pages * PF_IO_HDR_BYTES bytes,
 * 4 KiB aligned). Owned by the uring; valid until pf_uring_close. A page
 * named by an op must not be touched by the caller until the op completes. */
void *pf_uring_hdr_ptr(uint32_t uring);
/* What pf_uring_info reports (48 bytes). */
typedef struct pf_uring_stats {
  uint32_t depth;          /* offset 0 */
  uint32_t hdr_pages;      /* offset 4 */
  uint8_t fixed_buffers;   /* offset 8: 1: the pool is registered */
  uint8_t fixed_files;     /* offset 9: 1: files are registered */
  uint8_t reserved[6];
  uint64_t submitted;      /* offset 16: ops submitted */
  uint64_t completed;      /* offset 24: ops completed */
  uint64_t align_fallbacks; /* offset 32: ops that went buffered (alignment) */
  uint64_t inflight;       /* offset 40: ops in flight now */
} pf_uring_stats;
int32_t pf_uring_info(uint32_t uring, pf_uring_stats *out);
/* Stops accepting ops, waits for ops in flight, joins the reaper, closes
 * files still open on it. PF_EBUSY if called from the reaper itself.
 * Called off the caller's thread (it waits), so on failure the error text
 * is copied into `err` (`err_cap` bytes, NUL-terminated; may be NULL): the
 * thread-local pf_last_error is the calling thread's. */
int32_t pf_uring_close(uint32_t uring, char *err, uint32_t err_cap);

/* Opens (and registers) a file on `uring`. */
int32_t pf_file_open(uint32_t uring, const char *path, uint32_t flags,
                     uint32_t *out_file);
/* What pf_file_info reports (24 bytes). */
typedef struct pf_file_props {
  uint64_t bytes;        /* offset 0: size now */
  uint32_t offset_align; /* offset 8: O_DIRECT offset/length alignment */
  uint32_t mem_align;    /* offset 12: O_DIRECT memory alignment */
  uint32_t direct;       /* offset 16: 1 if opened O_DIRECT, 0 if buffered */
  uint32_t reserved;
} pf_file_props;
int32_t pf_file_info(uint32_t file, pf_file_props *out);
int32_t pf_file_size(uint32_t file, uint64_t *out_bytes);
/* ftruncate; PF_EIO with errno text on failure. */
int32_t pf_file_truncate(uint32_t file, uint64_t bytes);
/* Reserves [0, bytes) with fallocate so ENOSPC shows up now, not mid-write;
 * PF_EUNSUPPORTED where the filesystem has no fallocate. */
int32_t pf_file_allocate(uint32_t file, uint64_t bytes);
/* fdatasync (ops completed before the call are durable after it). On
 * failure the error text (path, errno) is copied into `err` as for
 * pf_uring_close: it runs off the caller's thread too. */
int32_t pf_file_sync(uint32_t file, char *err, uint32_t err_cap);
/* Drops the file's pages from the page cache (posix_fadvise DONTNEED), so a
 * buffered benchmark reads the device, not memory. */
int32_t pf_file_drop_cache(uint32_t file);
int32_t pf_file_close(uint32_t file); /* PF_EBUSY while ops in flight */

/* Filesystem space at a path (24 bytes). */
typedef struct pf_fs_usage {
  uint64_t total_bytes;     /* offset 0 */
  uint64_t available_bytes; /* offset 8: available to this process */
  uint64_t block_bytes;     /* offset 16: filesystem block size */
} pf_fs_usage;
/* Space of the filesystem holding `path` (a file or directory). */
int32_t pf_fs_space(const char *path, pf_fs_usage *out);
/* strerror(err) into buf (for PF_DONE_IO records, whose aux is the errno). */
int32_t pf_errno_text(int32_t err, char *buf, uint32_t cap);

/*
 * An io batch lives in one caller-owned buffer (copied before pf_io_submit
 * returns):
 *
 *   pf_io_batch_header
 *   pf_io_desc  ops[num_ops]
 *   pf_io_ext   exts[num_exts]
 *
 * Op i moves, at file_off, [header page hdr_page - 1 if hdr_page > 0] then
 * exts[first_ext .. first_ext + num_ext) in order. Every op is validated
 * (live file of this uring, op kind, extents inside the pool, header page in
 * range, 1 + num_ext <= 1024 iovecs, writes not to a read-only file) before
 * anything is queued: one bad op fails the whole batch with nothing done.
 *
 * Completions, all with the batch's tag: one PF_DONE_IO per op (index = op
 * index, in completion order; status PF_OK or PF_EIO; value = bytes moved;
 * aux = the errno on failure (a short transfer reports ENOSPC for a write,
 * ENODATA for a read), or the CRC32C with PF_IO_CRC), then one
 * PF_DONE_IO_BATCH (status = first failure or PF_OK, aux = failed ops,
 * value = bytes moved).
 */
typedef struct pf_io_batch_header {
  uint32_t num_ops;
  uint32_t num_exts;
  uint64_t reserved; /* 0 */
} pf_io_batch_header;

typedef struct pf_io_desc {
  uint32_t file;      /* file handle */
  uint32_t op;        /* pf_io_op */
  uint32_t flags;     /* pf_io_flags */
  uint32_t hdr_page;  /* staging page index + 1; 0 = no header page */
  uint64_t file_off;
  uint32_t first_ext;
  uint32_t num_ext;   /* 0 allowed only with a header page */
} pf_io_desc;

typedef struct pf_io_ext {
  uint64_t pool_off;
  uint64_t bytes;     /* > 0 */
} pf_io_ext;

/* Queues a batch and submits as much of it as fits (one io_uring_submit);
 * returns 0 once queued. Never blocks on the device. */
int32_t pf_io_submit(uint32_t uring, const void *desc, uint64_t desc_bytes,
                     uint64_t tag);

/* ---- integrity --------------------------------------------------------- */
/* CRC32C (Castagnoli, as iSCSI/ext4; SSE4.2 where the CPU has it) of each op
 * of an io batch descriptor (the layout above): out_crcs[i] covers op i's
 * pool extents in order, header page excluded. One call per batch. */
int32_t pf_pool_crc32c(uint32_t pool, const void *desc, uint64_t desc_bytes,
                       uint32_t *out_crcs);
/* CRC32C of `bytes` at `buf` continuing from `crc` (0 to start). */
uint32_t pf_crc32c(uint32_t crc, const void *buf, uint64_t bytes);
/* The unconditioned CRC32C state (no ~ in or out) continued over `bytes` at
 * `buf`: pieces of one message checksummed apart start from state 0 and are
 * joined in order with pf_crc32c_combine. */
uint32_t pf_crc32c_raw(uint32_t state, const void *buf, uint64_t bytes);
/* The state after `bytes` zero bytes more (x^(8*bytes) mod P; log2(bytes)
 * multiplications). */
uint32_t pf_crc32c_shift(uint32_t state, uint64_t bytes);
/* CRC32C of A followed by B, from crc_a = pf_crc32c(0, A) and
 * raw_b = pf_crc32c_raw(0, B) over bytes_b bytes. */
uint32_t pf_crc32c_combine(uint32_t crc_a, uint32_t raw_b, uint64_t bytes_b);
/* CRC32C per block of pool ranges: `exts` is num_exts pf_io_ext (pool_off,
 * bytes > 0); block b covers the next counts[b] of them in order, its CRC
 * continued across them, into out_crcs[b]. Every extent is checked against
 * the pool first (PF_ERANGE naming it); the counts must sum to num_exts
 * (PF_EINVAL). One call per batch; no limit on extents per block. */
int32_t pf_pool_checksums(uint32_t pool, const void *exts, uint64_t num_exts,
                          const uint32_t *counts, uint32_t num_blocks, uint32_t *out_crcs);

/* ---- prefix block hashes --------------------------------------------- */
/* The chained block hashes of num_blocks blocks of block_tokens token ids
 * each (little-endian u32, contiguous): block i's hash is the first
 * hash_bytes (1..32) of SHA-256(hash of block i-1 || block i's 4*block_tokens
 * bytes), block 0's parent being `parent` (hash_bytes long). Writes
 * num_blocks * hash_bytes bytes to `out`. One call per prompt
 * (python/pegaflow/hashes.py owns the formula). */
int32_t pf_chain_hashes(const uint32_t *tokens, uint64_t num_blocks, uint32_t block_tokens,
                        const uint8_t *parent, uint32_t hash_bytes, uint8_t *out);
/* "sha-ni" or "portable": the compression pf_chain_hashes runs (cpuid at
 * load; PF_SHA256=portable in the environment forces the C path). */
const char *pf_sha256_impl(void);

#ifdef __cplusplus
}
#endif

/* ---- cross-node transfer (TCP, RDMA verbs) ----------------------------- */
#include "pf_xfer.h"

#endif /* PEGAFLOW_H */
