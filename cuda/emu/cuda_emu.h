// The CUDA emulator: what a kernel in cuda/*.cu needs from CUDA, on the CPU, so that the CUDA
// backend's kernels and its host code can be run and checked against the CPU reference on a
// machine without a GPU (`CudaBackend::emulated`, TERN_CUDA_EMULATE=1 in the tests). A module is
// the same text NVRTC compiles, built with the host C++ compiler with this file force-included
// (-include) and TERN_CUDA_EMU defined.
//
// Execution model: the blocks of a launch are spread over a few OS threads; within a block
// every CUDA thread is a fiber (its own stack, switched by `tern_emu_swap`) on one OS thread,
// switched only at __syncthreads and at warp shuffles, so the block's threads see each other's shared-memory writes exactly at the
// barriers, as on the device. `__shared__` variables are function-local `static thread_local`:
// one copy per OS thread, used by one block at a time. A barrier that cannot complete (threads
// of a block or warp waiting at different barriers) aborts with a message: a divergent barrier
// is a bug on the device too.
//
// Numerics: IEEE f32 throughout (no fused multiply-add: -ffp-contract=off), the C library's
// expf/logf/sqrtf. Emulation only: slow, x86-64 Linux.
#pragma once

#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__ __restrict
#define __shared__ static thread_local

struct tern_dim3 {
    unsigned x, y, z;
};

struct float4 {
    float x, y, z, w;
};

struct uint4 {
    unsigned x, y, z, w;
};

static thread_local tern_dim3 threadIdx;
static thread_local tern_dim3 blockIdx;
static thread_local tern_dim3 blockDim;
static thread_local tern_dim3 gridDim;

static inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }

static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }

// f16 bits -> f32, exact (what cvt.f32.f16 does).
static inline float tern_emu_h2f(unsigned h) {
    unsigned sign = (h & 0x8000u) << 16;
    unsigned e = (h >> 10) & 0x1fu;
    unsigned m = h & 0x3ffu;
    if (e == 0x1fu) {
        return __uint_as_float(sign | 0x7f800000u | (m << 13));
    }
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// ---- fibers ---------------------------------------------------------------------------------

// Switches stacks: pushes the callee-saved registers, stores the stack pointer in *save, loads
// `to` and pops the registers saved there (x86-64 System V; no signal-mask system call, unlike
// swapcontext).
extern "C" __attribute__((visibility("hidden"))) void tern_emu_swap(void** save, void* to);
asm(R"(
    .text
    .p2align 4
    .globl tern_emu_swap
    .hidden tern_emu_swap
    .type tern_emu_swap,@function
tern_emu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tern_emu_swap, .-tern_emu_swap
)");

namespace tern_emu {

enum State { RUN, WAIT_BLOCK, WAIT_WARP, DONE };

// Kernel entry points take up to 16 integer-class arguments (pointers, u32) and up to 8 floats;
// on x86-64 System V each class is passed in its own sequence, so one call shape serves every
// kernel: the callee reads its integers from the integer sequence and its floats from the float
// one, in order.
typedef void (*Entry)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                      uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                      uint64_t, uint64_t, float, float, float, float, float, float, float, float);

struct Fiber {
    void* sp;
    State state;
    unsigned tid;
};

const size_t STACK_BYTES = 32 * 1024;

struct Block {
    Entry entry;
    const uint64_t* ints;
    const float* floats;
    unsigned n;
    std::vector<Fiber> fibers;
    char* stacks;
    void* sched_sp;
    Fiber* cur;
    float xchg[32][32];
};

static thread_local Block* g_block;

static inline void wait(State s) {
    Block* b = g_block;
    Fiber* f = b->cur;
    f->state = s;
    tern_emu_swap(&f->sp, b->sched_sp);
}

// The first code a fiber runs: the kernel for its thread, then back to the scheduler for good.
static void fiber_main() {
    Block* b = g_block;
    const uint64_t* i = b->ints;
    const float* x = b->floats;
    b->entry(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7], i[8], i[9], i[10], i[11], i[12],
             i[13], i[14], i[15], x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]);
    b = g_block;
    Fiber* f = b->cur;
    f->state = DONE;
    tern_emu_swap(&f->sp, b->sched_sp);
    std::abort();  // a finished fiber is never resumed
}

// A fresh stack for fiber `t` whose first switch-in "returns" into fiber_main.
static void prepare(Block& b, unsigned t) {
    char* top = b.stacks + (size_t)(t + 1) * STACK_BYTES;
    uintptr_t a = (uintptr_t)top & ~(uintptr_t)15;
    void** sp = (void**)a;
    *--sp = nullptr;                   // fiber_main's (unused) return address
    *--sp = (void*)&fiber_main;        // popped by tern_emu_swap's ret
    for (int r = 0; r < 6; r++) {
        *--sp = nullptr;               // rbp rbx r12 r13 r14 r15
    }
    b.fibers[t].sp = (void*)sp;
}

// Runs one block to completion.
static void run_block(Block& b) {
    g_block = &b;
    for (unsigned t = 0; t < b.n; t++) {
        b.fibers[t].tid = t;
        b.fibers[t].state = RUN;
        prepare(b, t);
    }
    for (;;) {
        for (unsigned t = 0; t < b.n; t++) {
            Fiber& f = b.fibers[t];
            if (f.state == RUN) {
                b.cur = &f;
                threadIdx.x = t;
                tern_emu_swap(&b.sched_sp, f.sp);
            }
        }
        bool released = false;
        // Warps whose live lanes all wait at a shuffle go on.
        for (unsigned w = 0; w * 32 < b.n; w++) {
            bool any = false;
            bool all = true;
            for (unsigned t = w * 32; t < b.n && t < w * 32 + 32; t++) {
                State s = b.fibers[t].state;
                if (s == DONE) {
                    continue;
                }
                any = true;
                all = all && s == WAIT_WARP;
            }
            if (any && all) {
                for (unsigned t = w * 32; t < b.n && t < w * 32 + 32; t++) {
                    if (b.fibers[t].state == WAIT_WARP) {
                        b.fibers[t].state = RUN;
                    }
                }
                released = true;
            }
        }
        if (released) {
            continue;
        }
        // The block barrier: every live thread waits at __syncthreads.
        bool all_done = true;
        bool all_block = true;
        for (unsigned t = 0; t < b.n; t++) {
            State s = b.fibers[t].state;
            if (s != DONE) {
                all_done = false;
                all_block = all_block && s == WAIT_BLOCK;
            }
        }
        if (all_done) {
            return;
        }
        if (!all_block) {
            std::fprintf(stderr,
                         "cuda emulator: block (%u,%u,%u): threads wait at different barriers "
                         "(divergent __syncthreads or shuffle)\n",
                         blockIdx.x, blockIdx.y, blockIdx.z);
            std::abort();
        }
        for (unsigned t = 0; t < b.n; t++) {
            if (b.fibers[t].state == WAIT_BLOCK) {
                b.fibers[t].state = RUN;
            }
        }
    }
}

// Fiber stacks, kept between launches.
static std::mutex g_arenas_lock;
static std::vector<char*> g_arenas;

static char* take_arena() {
    std::lock_guard<std::mutex> l(g_arenas_lock);
    if (g_arenas.empty()) {
        return new char[1024 * STACK_BYTES];
    }
    char* a = g_arenas.back();
    g_arenas.pop_back();
    return a;
}

static void give_arena(char* a) {
    std::lock_guard<std::mutex> l(g_arenas_lock);
    g_arenas.push_back(a);
}

}  // namespace tern_emu

static inline void __syncthreads() { tern_emu::wait(tern_emu::WAIT_BLOCK); }

static inline float __shfl_xor_sync(unsigned mask, float v, int o) {
    (void)mask;
    tern_emu::Block* b = tern_emu::g_block;
    unsigned tid = b->cur->tid;
    unsigned w = tid / 32;
    unsigned lane = tid % 32;
    b->xchg[w][lane] = v;
    tern_emu::wait(tern_emu::WAIT_WARP);
    float r = b->xchg[w][lane ^ (unsigned)o];
    tern_emu::wait(tern_emu::WAIT_WARP);
    return r;
}

// Runs a launch: `ints` and `floats` are the kernel's arguments of each class, in order (at most
// 16 and 8). Returns 0, or 1 when the launch cannot be emulated.
extern "C" int tern_emu_launch(void* entry, unsigned gx, unsigned gy, unsigned gz, unsigned block,
                               const uint64_t* ints, unsigned n_ints, const float* floats,
                               unsigned n_floats) {
    if (n_ints > 16 || n_floats > 8 || block == 0 || block > 1024) {
        return 1;
    }
    uint64_t iv[16] = {0};
    float fv[8] = {0};
    std::memcpy(iv, ints, n_ints * sizeof(uint64_t));
    std::memcpy(fv, floats, n_floats * sizeof(float));
    const uint64_t total = (uint64_t)gx * gy * gz;
    unsigned workers = std::thread::hardware_concurrency();
    if (workers == 0) {
        workers = 2;
    }
    // A thread costs more than a few small blocks.
    if (total * block < 4096) {
        workers = 1;
    }
    if ((uint64_t)workers > total) {
        workers = (unsigned)total;
    }
    auto work = [&](unsigned w) {
        tern_emu::Block b;
        b.entry = (tern_emu::Entry)entry;
        b.ints = iv;
        b.floats = fv;
        b.n = block;
        b.fibers.resize(block);
        b.stacks = tern_emu::take_arena();
        blockDim = {block, 1, 1};
        gridDim = {gx, gy, gz};
        threadIdx = {0, 0, 0};
        for (uint64_t i = w; i < total; i += workers) {
            blockIdx.x = (unsigned)(i % gx);
            blockIdx.y = (unsigned)((i / gx) % gy);
            blockIdx.z = (unsigned)(i / ((uint64_t)gx * gy));
            tern_emu::run_block(b);
        }
        tern_emu::give_arena(b.stacks);
    };
    if (workers <= 1) {
        work(0);
    } else {
        std::vector<std::thread> ts;
        for (unsigned w = 0; w < workers; w++) {
            ts.emplace_back(work, w);
        }
        for (auto& t : ts) {
            t.join();
        }
    }
    return 0;
}
