/* LD_PRELOAD shim used by `python -m keras_pipe.worker`: pins TensorFlow's
 * gRPC server to one address.
 *
 * TensorFlow's GrpcServer listens on "0.0.0.0:<port>" whatever the host in
 * the cluster spec (grpc_server_lib.cc), i.e. on every interface. This shim
 * wraps libc's bind(): a wildcard IPv4 bind is redirected to the address in
 * KERAS_PIPE_BIND_HOST, and a wildcard IPv6 bind is redirected there when
 * that address is IPv6, else refused (gRPC then falls back to IPv4). Every
 * other bind is passed through unchanged.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  static bind_fn real_bind = NULL;
  if (real_bind == NULL) {
    real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (real_bind == NULL) {
      errno = ENOSYS;
      return -1;
    }
  }
  const char *host = getenv("KERAS_PIPE_BIND_HOST");
  if (host == NULL || addr == NULL) {
    return real_bind(fd, addr, len);
  }
  if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
    struct sockaddr_in copy;
    memcpy(&copy, addr, sizeof(copy));
    if (copy.sin_addr.s_addr != htonl(INADDR_ANY)) {
      return real_bind(fd, addr, len);
    }
    if (inet_pton(AF_INET, host, &copy.sin_addr) != 1) {
      errno = EADDRNOTAVAIL;
      return -1;
    }
    return real_bind(fd, (const struct sockaddr *)&copy, sizeof(copy));
  }
  if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 copy;
    memcpy(&copy, addr, sizeof(copy));
    if (!IN6_IS_ADDR_UNSPECIFIED(&copy.sin6_addr)) {
      return real_bind(fd, addr, len);
    }
    if (inet_pton(AF_INET6, host, &copy.sin6_addr) != 1) {
      errno = EADDRNOTAVAIL;
      return -1;
    }
    return real_bind(fd, (const struct sockaddr *)&copy, sizeof(copy));
  }
  return real_bind(fd, addr, len);
}
