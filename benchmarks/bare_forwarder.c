/* Bare UDP forwarder: the physical limit for benchmarks/turn_saturation.py.
 *
 * The least work a relay can do on the load shape the benchmark offers, with
 * the same system calls a good relay uses (epoll + recvmmsg/sendmmsg, no copy):
 * no authentication, no permissions, no lifetimes, no metrics. It is not a TURN
 * server; it only forwards what the load generator sends.
 *
 * usage: bare_forwarder IPV4 LISTEN_PORT NRELAYS
 * Binds LISTEN_PORT and NRELAYS relay sockets (ephemeral ports) on IPV4, prints
 * "ready" and the relay ports on one line, then serves until killed.
 *
 * Control datagrams on the listening socket (first byte below 0x40 and not
 * STUN, so they never look like data):
 *   '!' RELAY(u16) CHANNEL(u16) PEER_IPV4(4) PEER_PORT(u16)
 *       -> "!ok" RELAY_PORT(u16). Binds (sender, CHANNEL) to relay socket
 *       RELAY and PEER, like Allocate + ChannelBind. CHANNEL 0 stands for a
 *       permission without a channel (Send/Data indications).
 *   '&' TOKEN(u32) -> "&ok". Two senders with the same token become a pair
 *       whose datagrams are forwarded to each other unchanged through the
 *       listening socket (the Unity Relay shape: one port, route by source).
 *
 * Data:
 *   on the listening socket: ChannelData (first byte 0x40-0x4F) is looked up by
 *   (source, channel) and its payload sent from the relay socket to the peer;
 *   a Send indication (type 0x0016) laid out as the benchmark sends it (XOR-PEER-
 *   ADDRESS first, then DATA, payload at byte 36) by (source, 0); anything else
 *   by (source, pair) and forwarded unchanged to the partner.
 *   on a relay socket: a datagram from the bound peer goes to the client as
 *   ChannelData (4-byte header) or a Data indication (36-byte header), the header
 *   in its own iovec before the received payload.
 * Loopback only by intent. Built by benchmarks/turn_saturation.py with `cc -O2`.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define BATCH 64
#define MAXRELAY 1024
#define SLOTS 8192 /* open-addressing table, a power of two above 2 x routes */
#define PAIR_CHANNEL 0xffffu
#define LISTEN_TAG 0xffffffffu

struct route {
    uint64_t key; /* ip << 32 | port << 16 | channel; 0 = empty */
    int relay;    /* relay index, or -1 for a pair */
    struct sockaddr_in dest;
};

struct relay {
    int fd;
    int bound;
    uint16_t channel;
    struct sockaddr_in client, peer;
};

static struct route table[SLOTS];
static struct relay relays[MAXRELAY];
static int nrelay;

static uint64_t key_of(const struct sockaddr_in *a, uint16_t channel) {
    return ((uint64_t)a->sin_addr.s_addr << 32) | ((uint64_t)a->sin_port << 16) | channel;
}

static struct route *lookup(uint64_t key, int insert) {
    uint64_t h = key * 0x9e3779b97f4a7c15ull;
    for (unsigned i = (unsigned)(h >> 51) & (SLOTS - 1), n = 0; n < SLOTS; i = (i + 1) & (SLOTS - 1), n++) {
        if (table[i].key == key) return &table[i];
        if (table[i].key == 0) {
            if (!insert) return NULL;
            table[i].key = key;
            return &table[i];
        }
    }
    return NULL;
}

static int udp_socket(const char *ip, int port) {
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
    int buf = 4 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, ip, &a.sin_addr);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0) { perror("bind"); exit(1); }
    return fd;
}

static int port_of(int fd) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &len);
    return ntohs(a.sin_port);
}

static unsigned char rbuf[BATCH][2048];
static struct sockaddr_in rsrc[BATCH];
static struct mmsghdr rmsg[BATCH];
static struct iovec riov[BATCH];
static struct mmsghdr smsg[BATCH];
static struct iovec siov[BATCH][2];
static unsigned char shdr[BATCH][36];
static uint32_t pending_token;
static struct sockaddr_in pending;
static int has_pending;

static void flush(int fd, int n) {
    int done = 0;
    while (done < n) {
        int r = sendmmsg(fd, smsg + done, n - done, MSG_DONTWAIT);
        if (r <= 0) break; /* full send buffer: drop, as a relay would */
        done += r;
    }
}

static void control(int lfd, const unsigned char *p, unsigned len, const struct sockaddr_in *src) {
    unsigned char reply[8];
    if (p[0] == '!' && len >= 11) {
        uint16_t index = (uint16_t)(p[1] << 8 | p[2]), channel = (uint16_t)(p[3] << 8 | p[4]);
        if (index >= nrelay) return;
        struct relay *r = &relays[index];
        struct route *route = lookup(key_of(src, channel), 1);
        if (route == NULL) return;
        r->bound = 1;
        r->channel = channel;
        r->client = *src;
        r->peer.sin_family = AF_INET;
        memcpy(&r->peer.sin_addr, p + 5, 4);
        memcpy(&r->peer.sin_port, p + 9, 2);
        route->relay = index;
        route->dest = r->peer;
        int port = port_of(r->fd);
        memcpy(reply, "!ok", 3);
        reply[3] = (unsigned char)(port >> 8);
        reply[4] = (unsigned char)port;
        sendto(lfd, reply, 5, 0, (const struct sockaddr *)src, sizeof *src);
    } else if (p[0] == '&' && len >= 5) {
        uint32_t token;
        memcpy(&token, p + 1, 4);
        if (has_pending && token == pending_token &&
            key_of(&pending, 0) != key_of(src, 0)) {
            struct route *a = lookup(key_of(&pending, PAIR_CHANNEL), 1);
            struct route *b = lookup(key_of(src, PAIR_CHANNEL), 1);
            if (a == NULL || b == NULL) return;
            a->relay = -1;
            a->dest = *src;
            b->relay = -1;
            b->dest = pending;
            has_pending = 0;
            sendto(lfd, "&ok", 3, 0, (const struct sockaddr *)&pending, sizeof pending);
        } else {
            has_pending = 1;
            pending_token = token;
            pending = *src;
        }
        sendto(lfd, "&ok", 3, 0, (const struct sockaddr *)src, sizeof *src);
    }
}

/* Datagrams from clients: to peers (one sendmmsg per run of the same relay
 * socket) or, for pairs, to the partner through the listening socket. */
static void from_clients(int lfd) {
    int got = recvmmsg(lfd, rmsg, BATCH, MSG_DONTWAIT, NULL);
    if (got <= 0) return;
    int n = 0, out_fd = -1;
    for (int k = 0; k < got; k++) {
        unsigned char *p = rbuf[k];
        unsigned len = rmsg[k].msg_len;
        if (len < 4) continue;
        uint16_t channel;
        unsigned offset, size;
        if (p[0] >= 0x40 && p[0] <= 0x4f) {
            channel = (uint16_t)(p[0] << 8 | p[1]);
            offset = 4;
            size = (unsigned)(p[2] << 8 | p[3]);
            if (size > len - 4) continue;
        } else if (p[0] == 0x00 && p[1] == 0x16 && len >= 36) {
            channel = 0;
            offset = 36;
            size = len - 36;
        } else if (p[0] == '!' || p[0] == '&') {
            control(lfd, p, len, &rsrc[k]);
            continue;
        } else {
            channel = PAIR_CHANNEL;
            offset = 0;
            size = len;
        }
        struct route *route = lookup(key_of(&rsrc[k], channel), 0);
        if (route == NULL) continue;
        int fd = route->relay < 0 ? lfd : relays[route->relay].fd;
        if (fd != out_fd && n > 0) {
            flush(out_fd, n);
            n = 0;
        }
        out_fd = fd;
        siov[n][0].iov_base = p + offset;
        siov[n][0].iov_len = size;
        smsg[n].msg_hdr.msg_iov = siov[n];
        smsg[n].msg_hdr.msg_iovlen = 1;
        smsg[n].msg_hdr.msg_name = &route->dest;
        smsg[n].msg_hdr.msg_namelen = sizeof route->dest;
        n++;
    }
    if (n > 0) flush(out_fd, n);
}

/* Datagrams from a relay socket's peer: to its client with a header. */
static void from_peer(int lfd, struct relay *r) {
    int got = recvmmsg(r->fd, rmsg, BATCH, MSG_DONTWAIT, NULL);
    if (got <= 0 || !r->bound) return;
    int n = 0;
    for (int k = 0; k < got; k++) {
        if (rsrc[k].sin_addr.s_addr != r->peer.sin_addr.s_addr || rsrc[k].sin_port != r->peer.sin_port)
            continue;
        unsigned len = rmsg[k].msg_len;
        unsigned char *h = shdr[n];
        size_t hlen;
        if (r->channel) {
            h[0] = (unsigned char)(r->channel >> 8);
            h[1] = (unsigned char)r->channel;
            h[2] = (unsigned char)(len >> 8);
            h[3] = (unsigned char)len;
            hlen = 4;
        } else {
            /* Data indication: XOR-PEER-ADDRESS, DATA (RFC 8656 §11.4). */
            static const unsigned char cookie[4] = {0x21, 0x12, 0xa4, 0x42};
            unsigned body = 12 + 4 + len + ((4 - len % 4) % 4);
            memset(h, 0, 36);
            h[1] = 0x17;
            h[2] = (unsigned char)(body >> 8);
            h[3] = (unsigned char)body;
            memcpy(h + 4, cookie, 4);
            h[21] = 0x12;
            h[23] = 8;
            h[25] = 1;
            uint16_t port = ntohs(rsrc[k].sin_port) ^ 0x2112;
            h[26] = (unsigned char)(port >> 8);
            h[27] = (unsigned char)port;
            memcpy(h + 28, &rsrc[k].sin_addr, 4);
            for (int i = 0; i < 4; i++) h[28 + i] ^= cookie[i];
            h[33] = 0x13;
            h[34] = (unsigned char)(len >> 8);
            h[35] = (unsigned char)len;
            hlen = 36;
        }
        siov[n][0].iov_base = h;
        siov[n][0].iov_len = hlen;
        siov[n][1].iov_base = rbuf[k];
        siov[n][1].iov_len = len;
        smsg[n].msg_hdr.msg_iov = siov[n];
        smsg[n].msg_hdr.msg_iovlen = 2;
        smsg[n].msg_hdr.msg_name = &r->client;
        smsg[n].msg_hdr.msg_namelen = sizeof r->client;
        n++;
    }
    if (n > 0) flush(lfd, n);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s IPV4 LISTEN_PORT NRELAYS\n", argv[0]);
        return 2;
    }
    nrelay = atoi(argv[3]);
    if (nrelay < 0 || nrelay > MAXRELAY) return 2;
    int lfd = udp_socket(argv[1], atoi(argv[2]));
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = LISTEN_TAG};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    printf("ready");
    for (int i = 0; i < nrelay; i++) {
        relays[i].fd = udp_socket(argv[1], 0);
        struct epoll_event rev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        epoll_ctl(ep, EPOLL_CTL_ADD, relays[i].fd, &rev);
        printf(" %d", port_of(relays[i].fd));
    }
    printf("\n");
    fflush(stdout);
    for (int k = 0; k < BATCH; k++) {
        riov[k].iov_base = rbuf[k];
        riov[k].iov_len = sizeof rbuf[k];
        rmsg[k].msg_hdr.msg_iov = &riov[k];
        rmsg[k].msg_hdr.msg_iovlen = 1;
        rmsg[k].msg_hdr.msg_name = &rsrc[k];
        rmsg[k].msg_hdr.msg_namelen = sizeof rsrc[k];
    }
    struct epoll_event events[BATCH];
    for (;;) {
        int ne = epoll_wait(ep, events, BATCH, -1);
        if (ne < 0 && errno != EINTR) { perror("epoll_wait"); return 1; }
        for (int e = 0; e < ne; e++) {
            uint32_t tag = events[e].data.u32;
            /* recvmmsg overwrites msg_namelen; restore it before each call. */
            for (int k = 0; k < BATCH; k++) rmsg[k].msg_hdr.msg_namelen = sizeof rsrc[k];
            if (tag == LISTEN_TAG)
                from_clients(lfd);
            else
                from_peer(lfd, &relays[tag]);
        }
    }
}
