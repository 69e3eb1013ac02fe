/* Pins TensorFlow's gRPC server to one address (Linux).
 *
 * TensorFlow's GrpcServer listens on "0.0.0.0:<port>" whatever the host in
 * the cluster spec (grpc_server_lib.cc), i.e. on every interface, in a
 * worker and in a client after `connect`. This library replaces bind() for
 * TensorFlow only: `keras_pipe_pin(host, filter)` rewrites, in every loaded
 * shared object whose path contains `filter`, the GOT slots that call
 * libc's bind() (JUMP_SLOT and GLOB_DAT relocations of the symbol "bind")
 * so that they call `keras_pipe_bind`. A wildcard IPv4 bind is then
 * redirected to `host`; a wildcard IPv6 bind is redirected there when
 * `host` is IPv6, else refused (gRPC then falls back to IPv4). Every other
 * bind is passed through unchanged, and Python's own sockets are not
 * touched. keras_pipe builds this file at install time (setup.py) and loads
 * it with ctypes after checking its hash (`keras_pipe/distributed/bind.py`).
 *
 * Loaded with LD_PRELOAD instead, its `bind` applies the same rule to the
 * whole process, with the host read from KERAS_PIPE_BIND_HOST.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static char pinned_host[INET6_ADDRSTRLEN + 1];

static bind_fn real_bind(void) {
  static bind_fn real = NULL;
  if (real == NULL) {
    real = (bind_fn)dlsym(RTLD_NEXT, "bind");
  }
  return real;
}

static int rewritten_bind(const char *host, int fd,
                          const struct sockaddr *addr, socklen_t len) {
  bind_fn real = real_bind();
  if (real == NULL) {
    errno = ENOSYS;
    return -1;
  }
  if (host == NULL || host[0] == '\0' || addr == NULL) {
    return real(fd, addr, len);
  }
  if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
    struct sockaddr_in copy;
    memcpy(&copy, addr, sizeof(copy));
    if (copy.sin_addr.s_addr != htonl(INADDR_ANY)) {
      return real(fd, addr, len);
    }
    if (inet_pton(AF_INET, host, &copy.sin_addr) != 1) {
      errno = EADDRNOTAVAIL;
      return -1;
    }
    return real(fd, (const struct sockaddr *)&copy, sizeof(copy));
  }
  if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 copy;
    memcpy(&copy, addr, sizeof(copy));
    if (!IN6_IS_ADDR_UNSPECIFIED(&copy.sin6_addr)) {
      return real(fd, addr, len);
    }
    if (inet_pton(AF_INET6, host, &copy.sin6_addr) != 1) {
      errno = EADDRNOTAVAIL;
      return -1;
    }
    return real(fd, (const struct sockaddr *)&copy, sizeof(copy));
  }
  return real(fd, addr, len);
}

/* The bind() that patched GOT slots call: the host given to keras_pipe_pin. */
int keras_pipe_bind(int fd, const struct sockaddr *addr, socklen_t len) {
  return rewritten_bind(pinned_host, fd, addr, len);
}

/* The LD_PRELOAD entry point. */
int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  const char *host = pinned_host[0] ? pinned_host
                                    : getenv("KERAS_PIPE_BIND_HOST");
  return rewritten_bind(host, fd, addr, len);
}

struct pin_request {
  const char *filter;
  int patched;
  int failed;
};

static uintptr_t adjust(uintptr_t value, uintptr_t base) {
  /* glibc relocates the d_ptr entries of _DYNAMIC in place; others may not. */
  return value < base ? value + base : value;
}

static int is_bind_slot(unsigned long type) {
#if defined(__x86_64__)
  return type == R_X86_64_JUMP_SLOT || type == R_X86_64_GLOB_DAT;
#elif defined(__aarch64__)
  return type == R_AARCH64_JUMP_SLOT || type == R_AARCH64_GLOB_DAT;
#else
  (void)type;
  return 0;
#endif
}

static void patch_table(struct dl_phdr_info *info, const ElfW(Rela) *rela,
                        size_t size, const ElfW(Sym) *symtab,
                        const char *strtab, struct pin_request *request) {
  long page = sysconf(_SC_PAGESIZE);
  size_t count = size / sizeof(ElfW(Rela));
  for (size_t k = 0; k < count; k++) {
    unsigned long type = ELF64_R_TYPE(rela[k].r_info);
    unsigned long sym = ELF64_R_SYM(rela[k].r_info);
    if (!is_bind_slot(type) || sym == 0) {
      continue;
    }
    if (strcmp(strtab + symtab[sym].st_name, "bind") != 0) {
      continue;
    }
    void **slot = (void **)(info->dlpi_addr + rela[k].r_offset);
    uintptr_t start = (uintptr_t)slot & ~(uintptr_t)(page - 1);
    if (mprotect((void *)start, (size_t)page, PROT_READ | PROT_WRITE) != 0) {
      request->failed++;
      continue;
    }
    *slot = (void *)&keras_pipe_bind;
    /* A slot inside PT_GNU_RELRO was read-only: make it read-only again. */
    for (int p = 0; p < info->dlpi_phnum; p++) {
      const ElfW(Phdr) *ph = &info->dlpi_phdr[p];
      uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
      if (ph->p_type == PT_GNU_RELRO && (uintptr_t)slot >= lo &&
          (uintptr_t)slot < lo + ph->p_memsz) {
        mprotect((void *)start, (size_t)page, PROT_READ);
      }
    }
    request->patched++;
  }
}

static int pin_object(struct dl_phdr_info *info, size_t size, void *data) {
  (void)size;
  struct pin_request *request = (struct pin_request *)data;
  if (info->dlpi_name == NULL || strstr(info->dlpi_name, request->filter) ==
                                     NULL) {
    return 0;
  }
  const ElfW(Dyn) *dyn = NULL;
  for (int p = 0; p < info->dlpi_phnum; p++) {
    if (info->dlpi_phdr[p].p_type == PT_DYNAMIC) {
      dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[p].p_vaddr);
    }
  }
  if (dyn == NULL) {
    return 0;
  }
  uintptr_t base = info->dlpi_addr, symtab = 0, strtab = 0, jmprel = 0,
            rela = 0;
  size_t jmprel_size = 0, rela_size = 0;
  for (; dyn->d_tag != DT_NULL; dyn++) {
    switch (dyn->d_tag) {
      case DT_SYMTAB: symtab = adjust(dyn->d_un.d_ptr, base); break;
      case DT_STRTAB: strtab = adjust(dyn->d_un.d_ptr, base); break;
      case DT_JMPREL: jmprel = adjust(dyn->d_un.d_ptr, base); break;
      case DT_PLTRELSZ: jmprel_size = dyn->d_un.d_val; break;
      case DT_RELA: rela = adjust(dyn->d_un.d_ptr, base); break;
      case DT_RELASZ: rela_size = dyn->d_un.d_val; break;
      default: break;
    }
  }
  if (symtab == 0 || strtab == 0) {
    return 0;
  }
  if (jmprel) {
    patch_table(info, (const ElfW(Rela) *)jmprel, jmprel_size,
                (const ElfW(Sym) *)symtab, (const char *)strtab, request);
  }
  if (rela) {
    patch_table(info, (const ElfW(Rela) *)rela, rela_size,
                (const ElfW(Sym) *)symtab, (const char *)strtab, request);
  }
  return 0;
}

/* Sets the address and patches the objects whose path contains `filter`.
 * Returns the number of slots patched, or -1 if `host` is not an address
 * or a slot could not be made writable. */
int keras_pipe_pin(const char *host, const char *filter) {
  struct in6_addr scratch;
  if (host == NULL || strlen(host) >= sizeof(pinned_host) ||
      (inet_pton(AF_INET, host, &scratch) != 1 &&
       inet_pton(AF_INET6, host, &scratch) != 1)) {
    return -1;
  }
  strcpy(pinned_host, host);
  struct pin_request request = {filter, 0, 0};
  dl_iterate_phdr(pin_object, &request);
  return request.failed ? -1 : request.patched;
}
