/*
 * pf_guard.c — a client's shared memory can vanish; the server must not.
 *
 * Engines hand the server MAP_SHARED mappings they still control: host-backend
 * KV regions and the load-state words. A client that shrinks such a file
 * (ftruncate) turns the server's next access to the vanished pages into
 * SIGBUS, whose default action kills the server and with it every other
 * engine's sessions and the whole RAM cache. A size check before the access
 * cannot close the race (the client can shrink the file between the check and
 * the copy), so every access the library makes to client memory runs inside
 * a guard window instead:
 *
 *   pf_guard_run(client_lo, client_bytes, fn, arg, &fault_off)
 *
 * pushes a thread-local frame (the client range and a sigjmp_buf) and calls
 * fn. A process-wide SIGBUS handler, installed once with SA_SIGINFO, jumps
 * back to that frame when the fault address lies inside the range the
 * faulting thread is guarding; pf_guard_run then returns PF_EFAULT with the
 * fault's offset, and the caller fails only that client's batch. Every other
 * SIGBUS (no frame on this thread, an address outside its range, a signal
 * sent with kill) goes to the handler that was installed before ours, or gets
 * the default action, so faults that are not ours keep their meaning. (V8
 * uses SIGSEGV, not SIGBUS, for its wasm traps; we touch only SIGBUS.)
 *
 * The frame pointer is an initial-exec TLS variable: reading it in the
 * handler is one load, never a lazy TLS allocation (which is not
 * async-signal-safe). sigsetjmp does not save the signal mask (that would be
 * a syscall per window on the hot path); the rare fault path unblocks SIGBUS
 * itself after the jump instead.
 */
#define _GNU_SOURCE
#include "pf_internal.h"

#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>

typedef struct pf_guard_frame {
  sigjmp_buf jb;
  uintptr_t lo;
  uint64_t bytes;
  uintptr_t fault;
  struct pf_guard_frame *prev;
} pf_guard_frame;

static __thread pf_guard_frame *guard_top
    __attribute__((tls_model("initial-exec")));
static struct sigaction prev_bus;
static pthread_once_t install_once = PTHREAD_ONCE_INIT;
static int install_errno;

/* Hands a fault that is not ours to whoever handled SIGBUS before us. */
static void chain(int sig, siginfo_t *si, void *uc) {
  if (prev_bus.sa_flags & SA_SIGINFO) {
    if (prev_bus.sa_sigaction) {
      prev_bus.sa_sigaction(sig, si, uc);
      return;
    }
  } else if (prev_bus.sa_handler != SIG_DFL && prev_bus.sa_handler != SIG_IGN) {
    prev_bus.sa_handler(sig);
    return;
  }
  /* Default action. A hardware fault re-executes the faulting instruction
   * when we return and then dies by SIGBUS as it would have without us; a
   * SIGBUS sent by kill() is re-raised (pending until we return). */
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, NULL);
  if (si->si_code <= 0) raise(sig);
}

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
  uintptr_t a = (uintptr_t)si->si_addr;
  /* si_code > 0: raised by the kernel for this access, not sent by kill(). */
  if (si->si_code > 0) {
    for (pf_guard_frame *f = guard_top; f; f = f->prev) {
      if (a >= f->lo && a - f->lo < f->bytes) {
        f->fault = a;
        siglongjmp(f->jb, 1);
      }
    }
  }
  chain(sig, si, uc);
}

static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  /* SA_ONSTACK: a handler we chain to may be the runtime's stack-overflow
   * detector, which needs the alternate stack the runtime set up. */
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGBUS, &sa, &prev_bus) != 0) install_errno = errno;
}

int32_t pf_guard_init(void) {
  pthread_once(&install_once, install);
  if (install_errno)
    return pf_fail(PF_EIO, "sigaction(SIGBUS): %s", strerror(install_errno));
  return PF_OK;
}

int32_t pf_guard_run(const void *client_lo, uint64_t client_bytes,
                     void (*fn)(void *arg), void *arg, uint64_t *fault_off) {
  pthread_once(&install_once, install);
  pf_guard_frame f;
  f.lo = (uintptr_t)client_lo;
  f.bytes = client_bytes;
  f.fault = 0;
  f.prev = guard_top;
  if (sigsetjmp(f.jb, 0)) {
    /* Back from the handler: SIGBUS is still blocked on this thread (the
     * kernel blocked it for the handler and siglongjmp did not restore the
     * mask); a later fault while blocked would kill the process. */
    guard_top = f.prev;
    sigset_t bus;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, NULL);
    if (fault_off) *fault_off = (uint64_t)(f.fault - f.lo);
    return PF_EFAULT;
  }
  guard_top = &f;
  atomic_signal_fence(memory_order_seq_cst);
  fn(arg);
  atomic_signal_fence(memory_order_seq_cst);
  guard_top = f.prev;
  return PF_OK;
}

typedef struct {
  void *dst;
  const void *src;
  uint64_t bytes;
} copy_args;

static void do_copy(void *x) {
  copy_args *c = x;
  memcpy(c->dst, c->src, c->bytes);
}

int32_t pf_guard_copy(void *dst, const void *src, uint64_t bytes,
                      const void *client_lo, uint64_t client_bytes,
                      uint64_t *fault_off) {
  copy_args c = {dst, src, bytes};
  return pf_guard_run(client_lo, client_bytes, do_copy, &c, fault_off);
}

typedef struct {
  void *addr;
  uint32_t value;
} store_args;

static void do_store(void *x) {
  store_args *s = x;
  atomic_store_explicit((_Atomic uint32_t *)s->addr, s->value,
                        memory_order_release);
}

int32_t pf_guard_store_u32(void *addr, uint32_t value, uint64_t *fault_off) {
  store_args s = {addr, value};
  return pf_guard_run(addr, sizeof(uint32_t), do_store, &s, fault_off);
}
