# PegaFlow build. The two commands a newcomer needs: `make serve`, `make test`.
# Everything installs from the npm registry (Deno) and Debian (liburing).

SHELL := /bin/bash
DENO ?= $(CURDIR)/node_modules/deno/deno
export DENO_DIR ?= $(CURDIR)/.cache/deno
BUILD := build
CC ?= gcc
NVCC ?= $(shell command -v nvcc 2>/dev/null)
CFLAGS := -O2 -g -fPIC -Wall -Wextra -Wno-unused-parameter -std=gnu11 -pthread -Icsrc
LDLIBS := -ldl -lpthread

CSRC := $(wildcard csrc/*.c)
OBJS := $(patsubst csrc/%.c,$(BUILD)/obj/%.o,$(CSRC))
HDRS := $(wildcard csrc/*.h)

# liburing is linked statically so GPU machines without it can load the .so.
LIBURING_A := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/liburing.a /usr/lib/liburing.a /usr/local/lib/liburing.a))

# The gather/scatter kernel is compiled to a fatbin and embedded; without nvcc
# the library still builds and reports that the kernel path is absent.
ifneq ($(and $(NVCC),$(wildcard csrc/pf_kernel.cu)),)
KERNEL_OBJ := $(BUILD)/obj/pf_kernel_fatbin.o
CFLAGS += -DPF_HAVE_FATBIN=1
endif

.PHONY: all deps deno liburing native test test-gpu serve bench clean
all: native

deps: deno liburing

deno: $(DENO)
$(DENO): package.json
	npm install --no-audit --no-fund
	@test -x $(DENO) || { echo "error: npm did not install the deno binary at $(DENO)"; exit 1; }
	@touch $(DENO)

liburing:
	@if [ ! -f /usr/include/liburing.h ]; then \
	  echo "installing liburing-dev (Debian package)"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq liburing-dev; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq liburing-dev; fi; \
	fi

native: liburing $(BUILD)/libpegaflow.so

$(BUILD)/obj/%.o: csrc/%.c $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/pf_kernel.fatbin: csrc/pf_kernel.cu $(HDRS)
	@mkdir -p $(BUILD)
	$(NVCC) -fatbin -O3 -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
	  -gencode=arch=compute_90,code=compute_90 -o $@ $<

$(BUILD)/obj/pf_kernel_fatbin.o: $(BUILD)/pf_kernel.fatbin
	@mkdir -p $(dir $@)
	cd $(BUILD) && ld -r -b binary -o obj/pf_kernel_fatbin.o pf_kernel.fatbin

# -z nodelete: a process that exits while a thread still sleeps in
# pf_ring_wait (e.g. on an uncaught error) must not have the library's code
# unmapped under that thread by dlclose. -z noexecstack: the embedded fatbin
# object carries no GNU-stack note.
$(BUILD)/libpegaflow.so: $(OBJS) $(KERNEL_OBJ)
	@mkdir -p $(BUILD)
	@test -n "$(LIBURING_A)" || { echo "error: liburing.a not found; run 'make liburing'"; exit 1; }
	$(CC) -shared -Wl,-z,noexecstack -Wl,-z,nodelete -o $@ $(OBJS) $(KERNEL_OBJ) $(LIBURING_A) $(LDLIBS)

test: deps native
	$(DENO) task test

test-gpu: deps native
	$(DENO) task test:gpu

serve: deps native
	$(DENO) task serve

bench: deps native
	$(DENO) task bench

clean:
	rm -rf $(BUILD)
