# PegaFlow build. The two commands a newcomer needs: `make serve`, `make test`.
# Everything installs from the npm registry (Deno) and Debian (liburing).

SHELL := /bin/bash
DENO ?= $(CURDIR)/tools/deno/node_modules/deno/deno
export DENO_DIR ?= $(CURDIR)/.cache/deno
# package.json only pins the Deno binary for npm; without this, `deno task`
# tries to install its platform packages and fails.
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
$(DENO): tools/deno/package.json
	npm install --prefix tools/deno --no-audit --no-fund
	@test -x $(DENO) || { echo "error: npm did not install the deno binary at $(DENO)"; exit 1; }
	@touch $(DENO)
	ln -sfn $(DENO) deno

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

# gRPC contract: static ts-proto codegen (run after editing proto/pegaflow.proto;
# the generated proto/pegaflow.ts is committed). Needs protoc (Debian package
# protobuf-compiler); ts-proto is installed from npm into build/proto-tools.
TS_PROTO_VERSION := 2.18.0
PROTO_TOOLS := $(BUILD)/proto-tools
.PHONY: proto
proto:
	@command -v protoc >/dev/null || { echo "error: protoc not found; install the Debian package protobuf-compiler"; exit 1; }
	@test -x $(PROTO_TOOLS)/node_modules/.bin/protoc-gen-ts_proto || \
	  npm install --no-audit --no-fund --prefix $(PROTO_TOOLS) ts-proto@$(TS_PROTO_VERSION)
	protoc --plugin=$(PROTO_TOOLS)/node_modules/.bin/protoc-gen-ts_proto --ts_proto_out=proto \
	  --ts_proto_opt=env=browser,outputServices=grpc-js,importSuffix=.ts,useOptionals=none,oneof=unions-value,outputJsonMethods=false \
	  -Iproto proto/pegaflow.proto
	sed -i 's|^import { BinaryReader, BinaryWriter } from "@bufbuild/protobuf/wire";|import { Buffer } from "node:buffer";\n&|' proto/pegaflow.ts
	$(DENO) fmt proto/pegaflow.ts

# Single-binary server (`deno compile`). deno compile needs the `denort`
# runtime, which only Deno's download host serves: use DENORT_BIN=/path/to/denort
# where that host is unreachable. The binary loads libpegaflow.so from
# PEGAFLOW_LIB (set it to build/libpegaflow.so or wherever you install it).
DENORT_HOST := https://dl.deno.land/
.PHONY: compile
compile: native
	@if [ -n "$$DENORT_BIN" ]; then \
	  test -x "$$DENORT_BIN" || { echo "error: DENORT_BIN=$$DENORT_BIN is not an executable denort binary"; exit 1; }; \
	elif ! curl -sfI --max-time 5 $(DENORT_HOST) >/dev/null 2>&1; then \
	  echo "error: deno compile needs the denort runtime from $(DENORT_HOST), which is unreachable here;"; \
	  echo "       download denort for Deno $$($(DENO) --version | head -1 | cut -d' ' -f2) elsewhere and run: DENORT_BIN=/path/to/denort make compile"; \
	  exit 1; \
	fi
	$(DENO) compile --allow-all --output $(BUILD)/pegaflow-serve main.ts
	@echo "built $(BUILD)/pegaflow-serve; run it with PEGAFLOW_LIB=$(CURDIR)/$(BUILD)/libpegaflow.so"
