/* Open-loop relay load generator for benchmarks/turn_saturation.py.
 *
 * The Python side does every control exchange (TURN Allocate with long-term
 * credentials, CreatePermission, ChannelBind; Unity Relay BIND/CONNECT) on its
 * own UDP sockets and hands them to this program as inherited file descriptors,
 * one line per *flow* on stdin:
 *
 *     SEND_FD DEST_IPV4 DEST_PORT HEADER_HEX RECV_FD
 *
 * A flow sends HEADER + PAYLOAD bytes from SEND_FD to DEST (ChannelData header,
 * Send indication header, Unity RELAY header, or nothing for a peer writing to a
 * relayed address) and expects the relayed datagram on RECV_FD. The last 12
 * bytes of every payload are a tag (flow id, sequence number, magic); a relayed
 * datagram is counted by the tag at the end of its payload (the DATA attribute
 * of a Data indication, else the whole datagram: ChannelData, RELAY frames and
 * what a peer receives end with the payload).
 *
 * Load: RATE datagrams/s in total, spread evenly over the flows, sent every
 * millisecond with one sendmmsg per flow and tick (open loop: nothing waits
 * for replies). After WARMUP seconds the next DURATION seconds are measured:
 * datagrams sent then carry a "measured" bit in their tag; after the window the
 * program stops sending, drains for DRAIN seconds, and prints one line:
 *
 *     offered=<sent/s in window> delivered=<measured received/s> sent=<n> received=<n>
 *     loss=<percent> short=<sendmmsg shortfalls> foreign=<unrecognised datagrams>
 *
 * usage: turn_load RATE WARMUP DURATION DRAIN PAYLOAD EPOCH < flows
 * EPOCH (a step number) goes into the tag's magic, so that datagrams of an
 * earlier step still queued somewhere never count in this one.
 * Built by benchmarks/turn_saturation.py with `cc -O2`. Loopback only by intent.
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
#include <time.h>
#include <unistd.h>

#define MAXFLOW 1024
#define MAXHEADER 64
#define MAXPAYLOAD 1200
#define BATCH 64
#define MIN_BATCH 8
#define MAX_WAIT 0.002 /* s: bounds the burst a batch makes */
#define MAGIC 0x43524c47u /* "CRLG", XORed with EPOCH */
#define MEASURED 0x80000000u

struct flow {
    int send_fd, recv_fd;
    struct sockaddr_in dest;
    unsigned char header[MAXHEADER];
    int header_len;
    uint32_t seq;
};

static struct flow flows[MAXFLOW];
static int nflow;
static uint32_t magic;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int parse_hex(const char *hex, unsigned char *out, int max) {
    if (strcmp(hex, "-") == 0) return 0;
    int n = (int)strlen(hex) / 2;
    if (n > max) return -1;
    for (int i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return -1;
        out[i] = (unsigned char)v;
    }
    return n;
}

/* The relayed payload inside a datagram: the value of the DATA attribute of a
 * Data indication (attributes may follow it: coturn adds XOR-PEER-ADDRESS,
 * SOFTWARE and FINGERPRINT after DATA), else the datagram itself. Sets *len;
 * NULL for a Data indication without a well-formed DATA attribute. */
static const unsigned char *payload_of(const unsigned char *p, unsigned *len) {
    if (*len >= 20 && p[0] == 0x00 && p[1] == 0x17) {
        unsigned offset = 20;
        while (offset + 4 <= *len) {
            unsigned type = (unsigned)(p[offset] << 8 | p[offset + 1]);
            unsigned size = (unsigned)(p[offset + 2] << 8 | p[offset + 3]);
            if (offset + 4 + size > *len) break;
            if (type == 0x0013) {
                *len = size;
                return p + offset + 4;
            }
            offset += 4 + ((size + 3) & ~3u);
        }
        return NULL;
    }
    return p;
}

/* 1 when the datagram ends (its payload ends) with a tag of this run; sets
 * *measured to the tag's "measured" bit. */
static int tag_of(const unsigned char *datagram, unsigned len, int *measured) {
    const unsigned char *p = payload_of(datagram, &len);
    if (p == NULL || len < 12) return 0;
    uint32_t flow, seq, tag_magic;
    memcpy(&flow, p + len - 12, 4);
    memcpy(&seq, p + len - 8, 4);
    memcpy(&tag_magic, p + len - 4, 4);
    if (ntohl(tag_magic) != magic || ntohl(flow) >= (uint32_t)nflow) return 0;
    *measured = (ntohl(seq) & MEASURED) != 0;
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s RATE WARMUP DURATION DRAIN PAYLOAD EPOCH < flows\n", argv[0]);
        return 2;
    }
    double rate = atof(argv[1]), warmup = atof(argv[2]), duration = atof(argv[3]);
    double drain = atof(argv[4]);
    int payload = atoi(argv[5]);
    magic = MAGIC ^ (uint32_t)strtoul(argv[6], NULL, 10);
    if (rate <= 0 || payload < 12 || payload > MAXPAYLOAD || payload % 4) return 2;

    char hex[2 * MAXHEADER + 8], ip[64];
    int sfd, rfd, port;
    while (nflow < MAXFLOW && scanf("%d %63s %d %135s %d", &sfd, ip, &port, hex, &rfd) == 5) {
        struct flow *f = &flows[nflow];
        f->send_fd = sfd;
        f->recv_fd = rfd;
        f->dest.sin_family = AF_INET;
        f->dest.sin_port = htons((uint16_t)port);
        if (inet_pton(AF_INET, ip, &f->dest.sin_addr) != 1) return 2;
        f->header_len = parse_hex(hex, f->header, MAXHEADER);
        if (f->header_len < 0) return 2;
        f->seq = 0;
        nflow++;
    }
    if (nflow == 0) return 2;

    /* Every distinct receive fd goes into one epoll set (a fd may serve
     * several flows: a client socket receives both ChannelData and nothing
     * else, a peer socket the traffic of its allocation). */
    int ep = epoll_create1(0);
    int rfds[MAXFLOW], nr = 0;
    for (int i = 0; i < nflow; i++) {
        int seen = 0;
        for (int k = 0; k < nr; k++) seen |= rfds[k] == flows[i].recv_fd;
        if (seen) continue;
        rfds[nr++] = flows[i].recv_fd;
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = flows[i].recv_fd};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, flows[i].recv_fd, &ev) != 0) { perror("epoll_ctl"); return 1; }
    }

    static unsigned char sbuf[BATCH][MAXHEADER + MAXPAYLOAD];
    struct mmsghdr smsg[BATCH];
    struct iovec siov[BATCH];
    static unsigned char rbuf[BATCH][2048];
    struct mmsghdr rmsg[BATCH];
    struct iovec riov[BATCH];
    memset(sbuf, 0xa5, sizeof sbuf);
    for (int k = 0; k < BATCH; k++) {
        memset(&smsg[k], 0, sizeof smsg[k]);
        smsg[k].msg_hdr.msg_iov = &siov[k];
        smsg[k].msg_hdr.msg_iovlen = 1;
        riov[k].iov_base = rbuf[k];
        riov[k].iov_len = sizeof rbuf[k];
        memset(&rmsg[k], 0, sizeof rmsg[k]);
        rmsg[k].msg_hdr.msg_iov = &riov[k];
        rmsg[k].msg_hdr.msg_iovlen = 1;
    }

    unsigned long long sent_measured = 0, recv_measured = 0, shortfalls = 0, foreign = 0;
    double start = now(), t_begin = start + warmup, t_end = t_begin + duration;
    double t_stop = t_end + drain;
    double per_flow = rate / nflow;
    double due_base = start;
    unsigned long long scheduled = 0; /* per-flow datagrams due so far */
    double last_send = start;
    struct epoll_event events[MAXFLOW];
    double t;
    while ((t = now()) < t_stop) {
        if (t < t_end) {
            /* Open loop: every flow gets floor(per_flow * elapsed) datagrams in
             * total; what sendmmsg refuses (full send buffer) is not retried. */
            unsigned long long due = (unsigned long long)(per_flow * (t - due_base));
            int measured = t >= t_begin;
            /* At least MIN_BATCH datagrams per flow and sendmmsg, unless the
             * oldest due one has waited MAX_WAIT: fewer system calls per
             * datagram, so that the generator outruns a relay doing the same
             * kernel work per datagram. */
            if (due - scheduled < MIN_BATCH && t - last_send < MAX_WAIT) due = scheduled;
            if (due > scheduled) last_send = t;
            while (scheduled < due) {
                unsigned long long n64 = due - scheduled;
                int n = n64 > BATCH ? BATCH : (int)n64;
                for (int i = 0; i < nflow; i++) {
                    struct flow *f = &flows[i];
                    int len = f->header_len + payload;
                    for (int k = 0; k < n; k++) {
                        unsigned char *p = sbuf[k];
                        memcpy(p, f->header, f->header_len);
                        uint32_t tag[3] = {htonl((uint32_t)i),
                                           htonl((f->seq++ & ~MEASURED) | (measured ? MEASURED : 0)),
                                           htonl(magic)};
                        memcpy(p + len - 12, tag, 12);
                        siov[k].iov_base = p;
                        siov[k].iov_len = (size_t)len;
                        smsg[k].msg_hdr.msg_name = &f->dest;
                        smsg[k].msg_hdr.msg_namelen = sizeof f->dest;
                    }
                    int r = sendmmsg(f->send_fd, smsg, n, MSG_DONTWAIT);
                    if (r < 0) r = 0;
                    if (r < n) shortfalls += (unsigned long long)(n - r);
                    if (measured) sent_measured += (unsigned long long)r;
                }
                scheduled += (unsigned long long)n;
            }
        }
        int ne = epoll_wait(ep, events, MAXFLOW, 1);
        for (int e = 0; e < ne; e++) {
            int fd = events[e].data.fd;
            for (;;) {
                int got = recvmmsg(fd, rmsg, BATCH, MSG_DONTWAIT, NULL);
                if (got <= 0) break;
                for (int k = 0; k < got; k++) {
                    int measured = 0;
                    if (tag_of(rbuf[k], rmsg[k].msg_len, &measured))
                        recv_measured += (unsigned long long)measured;
                    else
                        foreign++;
                }
                if (got < BATCH) break;
            }
        }
    }
    double loss = sent_measured ? 100.0 * (1.0 - (double)recv_measured / (double)sent_measured) : 100.0;
    if (loss < 0) loss = 0; /* duplicates cannot make loss negative */
    printf("offered=%.1f delivered=%.1f sent=%llu received=%llu loss=%.4f short=%llu foreign=%llu\n",
           sent_measured / duration, recv_measured / duration, sent_measured, recv_measured, loss,
           shortfalls, foreign);
    return 0;
}
