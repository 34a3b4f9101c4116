# PegaFlow build. The two commands a newcomer needs: `make serve`, `make test`.
# Everything installs from the npm registry (Deno) and Debian (liburing,
# protoc, the Python packages the engines' side is tested with).
#
# Rule for every install step: nothing that an install creates may be looked
# up while the Makefile is parsed ($(wildcard) and $(shell) run before any
# recipe). Look such things up inside the recipe that uses them.

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
# Resolved when the link runs (after `liburing` may have installed it).
LIBURING_CANDIDATES := /usr/lib/x86_64-linux-gnu/liburing.a /usr/lib/aarch64-linux-gnu/liburing.a /usr/lib/liburing.a /usr/local/lib/liburing.a
find_liburing = $$(for f in $(LIBURING_CANDIDATES); do [ -f $$f ] && { echo $$f; break; }; done)

# The Python that sees Debian's python3-* packages (CI and the README use it).
PYTHON ?= /usr/bin/python3
# python3-pip and python3-venv: the packaging test builds the wheel and installs it offline.
PY_DEBS := python3-grpcio python3-protobuf python3-numpy python3-pytest python3-torch python3-pip python3-venv

# apt_install(packages): Debian install as root or through sudo.
define apt_install
if [ "$$(id -u)" = 0 ]; then s=; else s=sudo; fi; \
  $$s apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$s apt-get install -y -qq $(1)
endef

# The gather/scatter kernel is compiled to a fatbin and embedded; without nvcc
# the library still builds and reports that the kernel path is absent.
ifneq ($(and $(NVCC),$(wildcard csrc/pf_kernel.cu)),)
KERNEL_OBJ := $(BUILD)/obj/pf_kernel_fatbin.o
CFLAGS += -DPF_HAVE_FATBIN=1
endif

.PHONY: all deps deno liburing python-deps redis protoc native test test-gpu test-deno test-python serve bench clean
all: native

deps: deno liburing python-deps redis

deno: $(DENO)
$(DENO): tools/deno/package.json
	npm install --prefix tools/deno --no-audit --no-fund
	@test -x $(DENO) || { echo "error: npm did not install the deno binary at $(DENO)"; exit 1; }
	@touch $(DENO)
	ln -sfn $(DENO) deno

liburing:
	@if [ ! -f /usr/include/liburing.h ] || [ -z "$(find_liburing)" ]; then \
	  echo "installing liburing-dev (Debian package)"; \
	  $(call apt_install,liburing-dev); \
	fi

# The engines' side (python/) is tested with Debian's packages under /usr/bin/python3.
# (setuptools is imported before pip: pip first trips Debian's distutils shim.)
python-deps:
	@if ! $(PYTHON) -c 'import grpc, google.protobuf, numpy, pytest, torch, setuptools, wheel, pip, ensurepip' 2>/dev/null; then \
	  echo "installing $(PY_DEBS) (Debian packages)"; \
	  $(call apt_install,$(PY_DEBS)); \
	fi

# The cross-node block index is tested against a real redis-server (over TLS too:
# openssl makes the tests' throwaway CA and certificates).
redis:
	@command -v redis-server >/dev/null || { echo "installing redis-server (Debian package)"; \
	  $(call apt_install,redis-server); }
	@command -v openssl >/dev/null || { echo "installing openssl (Debian package)"; \
	  $(call apt_install,openssl); }

protoc:
	@command -v protoc >/dev/null || { echo "installing protobuf-compiler (Debian package)"; \
	  $(call apt_install,protobuf-compiler); }

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
	@a="$(find_liburing)"; test -n "$$a" || { echo "error: liburing.a not found in $(LIBURING_CANDIDATES); run 'make liburing'"; exit 1; }; \
	  echo "$(CC) -shared ... $$a"; \
	  $(CC) -shared -Wl,-z,noexecstack -Wl,-z,nodelete -o $@ $(OBJS) $(KERNEL_OBJ) $$a $(LDLIBS)

# Both suites always run; the target fails if either did (.ci/run sums both).
test: deps native
	@rc=0; $(MAKE) --no-print-directory test-deno || rc=1; \
	  $(MAKE) --no-print-directory test-python || rc=1; exit $$rc

test-deno:
	$(DENO) task test

test-python:
	@if [ -d python/tests ]; then cd python && $(PYTHON) -m pytest -q -p no:cacheprovider tests; \
	  else echo "no python/tests yet"; fi

test-gpu: deno liburing native
	$(DENO) task test:gpu

serve: deno liburing native
	$(DENO) task serve

bench: deno liburing native
	$(DENO) task bench

clean:
	rm -rf $(BUILD)

# gRPC contract: static ts-proto codegen (run after editing proto/pegaflow.proto;
# the generated proto/pegaflow.ts is committed). Needs protoc (Debian package
# protobuf-compiler); ts-proto is installed from npm into build/proto-tools.
TS_PROTO_VERSION := 2.18.0
PROTO_TOOLS := $(BUILD)/proto-tools
.PHONY: proto proto-py
proto: protoc proto-py
	@test -x $(PROTO_TOOLS)/node_modules/.bin/protoc-gen-ts_proto || \
	  npm install --no-audit --no-fund --prefix $(PROTO_TOOLS) ts-proto@$(TS_PROTO_VERSION)
	protoc --plugin=$(PROTO_TOOLS)/node_modules/.bin/protoc-gen-ts_proto --ts_proto_out=proto \
	  --ts_proto_opt=env=browser,outputServices=grpc-js,importSuffix=.ts,useOptionals=none,oneof=unions-value,outputJsonMethods=false \
	  -Iproto proto/pegaflow.proto
	sed -i 's|^import { BinaryReader, BinaryWriter } from "@bufbuild/protobuf/wire";|import { Buffer } from "node:buffer";\n&|' proto/pegaflow.ts
	$(DENO) fmt proto/pegaflow.ts

# Python messages for python/pegaflow (committed). Debian's protoc 3.21 output
# loads under protobuf 3.21 (CI) and the newer runtimes of the GPU machine.
PY_PROTO_DIR := python/pegaflow/_proto
proto-py: protoc
	@mkdir -p $(PY_PROTO_DIR)
	protoc -Iproto --python_out=$(PY_PROTO_DIR) proto/pegaflow.proto

# Single-binary server (`deno compile`). deno compile needs the `denort`
# runtime, which only Deno's download host serves: use DENORT_BIN=/path/to/denort
# where that host is unreachable. The binary loads libpegaflow.so from
# PEGAFLOW_LIB (set it to build/libpegaflow.so or wherever you install it).
DENORT_HOST := https://dl.deno.land/
# The server's V8 flags, as deno.json's serve task spells them (lib/server/v8_flags.ts).
SERVE_V8_FLAGS = $(shell grep -o -- '--v8-flags=[^ "]*' deno.json | head -1)
# Deno 2.9.6's compile overflows its stack on the 2 MB test data of bintrees (prom-client ->
# tdigest -> bintrees; a two-line file importing it aborts the same way); its tests are not run.
NPM_CACHE = $(shell DENO_DIR=$(DENO_DIR) $(DENO) info --json 2>/dev/null | $(PYTHON) -c 'import json,sys; print(json.load(sys.stdin)["npmCache"])')
.PHONY: compile
compile: native
	@if [ -n "$$DENORT_BIN" ]; then \
	  test -x "$$DENORT_BIN" || { echo "error: DENORT_BIN=$$DENORT_BIN is not an executable denort binary"; exit 1; }; \
	elif ! curl -sfI --max-time 5 $(DENORT_HOST) >/dev/null 2>&1; then \
	  echo "error: deno compile needs the denort runtime from $(DENORT_HOST), which is unreachable here;"; \
	  echo "       download denort for Deno $$($(DENO) --version | head -1 | cut -d' ' -f2) elsewhere and run: DENORT_BIN=/path/to/denort make compile"; \
	  exit 1; \
	fi
	$(DENO) compile --allow-all $(SERVE_V8_FLAGS) --exclude "$(NPM_CACHE)/registry.npmjs.org/bintrees/1.0.2/test" \
	  --output $(BUILD)/pegaflow-serve main.ts
	@echo "built $(BUILD)/pegaflow-serve; run it with PEGAFLOW_LIB=$(CURDIR)/$(BUILD)/libpegaflow.so"
