// The native kernels' thread runner (defined in attention.cpp): f(worker) on up to
// `nth` workers of torch's own OpenMP team (worker 0 is the calling thread), or on
// std::threads where torch has none. f must share its work dynamically.
#pragma once

#include <functional>

void kv_parallel(int nth, std::function<void(int)> f);
