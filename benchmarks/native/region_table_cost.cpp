// What the shm region table (fabric/region_table.hpp) costs a writer per work request: the
// check against the target's entry (a seqlock read, the hold taken, the entry read again, the
// range compared) and the hold's release when the write is reported, in a loop over 64 live
// regions, without a provider. The median of five runs of 5 million is printed.
//
//   g++ -std=c++17 -O2 -I packages/fabric-core/src/fabric_core/include \
//       benchmarks/native/region_table_cost.cpp -o /tmp/region_table_cost && /tmp/region_table_cost
#include <fabric/region_table.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

using fabric::region_table::Owner;
using fabric::region_table::View;

int main() {
    const std::string address = "fi_shm://region-table-cost-" + std::to_string(getpid());
    Owner owner(address);
    for (uint64_t key = 1; key <= 64; key++) owner.add(key, key << 20, 1 << 20, true);
    View view(address);
    const int n = 5'000'000;
    std::vector<double> runs;
    std::atomic<int64_t>* hold = nullptr;
    std::string why;
    uint64_t refused = 0;
    for (int r = 0; r < 5; r++) {
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < n; i++) {
            uint64_t key = 1 + (i & 63);
            if (view.check(key, (key << 20) + 64, 4096, 0, hold, why) == View::kHeld) {
                View::release(hold);
            } else {
                refused++;
            }
        }
        runs.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n);
    }
    std::sort(runs.begin(), runs.end());
    std::printf("region table: %.1f ns per work request (check, hold, release; median of 5 runs of %d)%s\n", runs[2],
                n, refused ? " REFUSED SOME" : "");
    return refused ? 1 : 0;
}
