// The hardware floor of a flag round trip between two cores: one cache line
// bounced between two threads pinned to two cores (each waits for the other's
// store, then stores). Prints nanoseconds per round trip (median of 21 runs).
//   cc -O2 -pthread cache_line_round_trip.c -o rt && ./rt CORE_A CORE_B [ROUND_TRIPS]
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static _Alignas(64) _Atomic unsigned long ball;
static long trips;

static void pin(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) {
    fprintf(stderr, "cannot pin to core %d\n", core);
    exit(1);
  }
}

static void* partner(void* core) {
  pin(*(int*)core);
  for (unsigned long n = 1; n <= 21UL * trips; ++n) {  // answers every odd value with the next even one
    while (atomic_load_explicit(&ball, memory_order_acquire) != 2 * n - 1) __builtin_ia32_pause();
    atomic_store_explicit(&ball, 2 * n, memory_order_release);
  }
  return NULL;
}

static int by_value(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc < 3) return fprintf(stderr, "usage: %s CORE_A CORE_B [ROUND_TRIPS]\n", argv[0]), 2;
  int a = atoi(argv[1]), b = atoi(argv[2]);
  trips = argc > 3 ? atol(argv[3]) : 100000;
  pthread_t t;
  pin(a);
  pthread_create(&t, NULL, partner, &b);
  double runs[21];
  unsigned long n = 0;
  for (int r = 0; r < 21; ++r) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < trips; ++i) {
      ++n;
      atomic_store_explicit(&ball, 2 * n - 1, memory_order_release);
      while (atomic_load_explicit(&ball, memory_order_acquire) != 2 * n) __builtin_ia32_pause();
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    runs[r] = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / trips;
  }
  pthread_join(t, NULL);
  qsort(runs, 21, sizeof runs[0], by_value);
  printf("%.1f\n", runs[10]);
  return 0;
}
