// Whether a kernel's setmaxnreg budgets fit the registers its CTA is launched with. A CTA gets
// the launch bounds' share of the SM's 64K registers (rounded down to 8 per thread) and keeps it:
// setmaxnreg only moves registers inside that pool, and an increase waits until decreases have
// freed enough, for ever if they never do (a d64 kernel with two CTAs per SM hangs that way).
#pragma once

namespace fa4::sm90 {

constexpr int kSmRegisters = 64 * 1024;

// Registers per thread at launch with `threads` per CTA and `ctas_per_sm` resident CTAs.
constexpr int launch_registers(int threads, int ctas_per_sm) {
  return kSmRegisters / (threads * ctas_per_sm) / 8 * 8;
}

// A producer warpgroup at `producer` registers per thread beside `warpgroups` warpgroups at
// `consumer`, in a CTA of 1 + warpgroups warpgroups.
constexpr bool register_budget_fits(int producer, int warpgroups, int consumer,
                                    int ctas_per_sm = 1) {
  return producer + warpgroups * consumer <=
         (1 + warpgroups) * launch_registers(128 * (1 + warpgroups), ctas_per_sm);
}

static_assert(register_budget_fits(24, 2, 240) && register_budget_fits(32, 3, 160));
static_assert(!register_budget_fits(24, 2, 112, 2) && register_budget_fits(24, 2, 104, 2),
              "two CTAs of 384 threads are launched with 80 registers per thread");

}  // namespace fa4::sm90
