/* The --allow-upstream list (see netallow.h). */
#include "transport/netallow.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wtx/error.h"

typedef struct net {
  int family;          /* AF_INET or AF_INET6 */
  unsigned char a[16]; /* network address */
  int bits;            /* prefix length */
} net;

struct wtx__netallow {
  net *nets;
  size_t n, cap;
};

static int add(wtx__netallow *a, int family, const void *addr, int bits) {
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 8;
    net *g = realloc(a->nets, cap * sizeof *g);
    if (g == NULL) return WTX_ENOMEM;
    a->nets = g;
    a->cap = cap;
  }
  net *x = &a->nets[a->n++];
  x->family = family;
  memset(x->a, 0, sizeof x->a);
  memcpy(x->a, addr, family == AF_INET ? 4 : 16);
  x->bits = bits;
  return 0;
}

/* Every address of a host name, each as a /32 or /128. */
static int add_host(wtx__netallow *a, const char *host) {
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
  if (getaddrinfo(host, NULL, &hints, &ai) != 0 || ai == NULL) return WTX_EINVAL;
  int rc = 0;
  for (struct addrinfo *p = ai; p != NULL && rc == 0; p = p->ai_next) {
    if (p->ai_family == AF_INET)
      rc = add(a, AF_INET, &((struct sockaddr_in *)p->ai_addr)->sin_addr, 32);
    else if (p->ai_family == AF_INET6)
      rc = add(a, AF_INET6, &((struct sockaddr_in6 *)p->ai_addr)->sin6_addr, 128);
  }
  freeaddrinfo(ai);
  return rc;
}

/* One entry: "addr/bits", "addr" or a host name. */
static int add_entry(wtx__netallow *a, char *e) {
  char *slash = strchr(e, '/');
  int bits = -1;
  if (slash != NULL) {
    char *end;
    long b = strtol(slash + 1, &end, 10);
    if (*end != '\0' || slash[1] == '\0' || b < 0 || b > 128) return WTX_EINVAL;
    bits = (int)b;
    *slash = '\0';
  }
  unsigned char buf[16];
  if (inet_pton(AF_INET, e, buf) == 1)
    return bits > 32 ? WTX_EINVAL : add(a, AF_INET, buf, bits < 0 ? 32 : bits);
  if (inet_pton(AF_INET6, e, buf) == 1) return add(a, AF_INET6, buf, bits < 0 ? 128 : bits);
  return bits >= 0 ? WTX_EINVAL : add_host(a, e);
}

int wtx__netallow_parse(const char *list, wtx__netallow **out, char *err, size_t errlen) {
  *out = NULL;
  if (list == NULL || list[0] == '\0') return 0;
  wtx__netallow *a = calloc(1, sizeof *a);
  char *copy = strdup(list);
  int rc = a != NULL && copy != NULL ? 0 : WTX_ENOMEM;
  char *save = NULL;
  for (char *e = rc == 0 ? strtok_r(copy, ",", &save) : NULL; e != NULL && rc == 0;
       e = strtok_r(NULL, ",", &save)) {
    while (*e == ' ') e++;
    char entry[300];
    snprintf(entry, sizeof entry, "%s", e);
    if ((rc = add_entry(a, e)) == WTX_EINVAL)
      snprintf(err, errlen, "allow_upstream: '%s' is not an address, network or "
               "resolvable host", entry);
  }
  free(copy);
  if (rc == 0 && a->n == 0) {
    snprintf(err, errlen, "allow_upstream: no entry in '%s'", list);
    rc = WTX_EINVAL;
  }
  if (rc != 0) {
    wtx__netallow_destroy(a);
    return rc;
  }
  *out = a;
  return 0;
}

void wtx__netallow_destroy(wtx__netallow *a) {
  if (a == NULL) return;
  free(a->nets);
  free(a);
}

static int prefix_equal(const unsigned char *x, const unsigned char *y, int bits) {
  int bytes = bits / 8, rest = bits % 8;
  if (memcmp(x, y, (size_t)bytes) != 0) return 0;
  if (rest == 0) return 1;
  unsigned char mask = (unsigned char)(0xFF << (8 - rest));
  return (x[bytes] & mask) == (y[bytes] & mask);
}

int wtx__netallow_admits(const wtx__netallow *a, const struct sockaddr *addr) {
  if (a == NULL) return 1;
  const unsigned char *bytes;
  int family = addr->sa_family;
  if (family == AF_INET) {
    bytes = (const unsigned char *)&((const struct sockaddr_in *)addr)->sin_addr;
  } else if (family == AF_INET6) {
    bytes = (const unsigned char *)&((const struct sockaddr_in6 *)addr)->sin6_addr;
  } else {
    return 0;
  }
  for (size_t i = 0; i < a->n; i++)
    if (a->nets[i].family == family && prefix_equal(a->nets[i].a, bytes, a->nets[i].bits))
      return 1;
  return 0;
}
