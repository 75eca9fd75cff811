// Files in /dev/shm that a process killed outright left behind: shm provider regions
// (fabric-efa's libfabric_domain.hpp) and the CUDA IPC domain's handle tables and inboxes
// (fabric/cuda_ipc.hpp) are named after their process, and nothing else removes them.
#pragma once

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <string>

namespace fabric {

// Removes each file of ``dir`` whose name ``pid_of(name)`` maps to a pid > 0 of a process
// that is gone (kill(pid, 0) says ESRCH) and that belongs to this user; a live process's
// files, and names pid_of returns 0 for, stay. Returns how many went.
template <class PidOf>
size_t remove_orphans(const char* dir_path, PidOf pid_of) {
    DIR* dir = opendir(dir_path);
    if (!dir) return 0;
    size_t removed = 0;
    const uid_t me = getuid();
    while (dirent* e = readdir(dir)) {
        int pid = pid_of(e->d_name);
        if (pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH) continue;
        std::string path = std::string(dir_path) + "/" + e->d_name;
        struct stat st{};
        if (stat(path.c_str(), &st) != 0 || st.st_uid != me) continue;
        if (unlink(path.c_str()) == 0) removed++;
    }
    closedir(dir);
    return removed;
}

}  // namespace fabric
