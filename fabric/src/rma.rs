//! The safe layer: a provider's fabric and domain ([`Fabric`]), reliable unconnected endpoints
//! with their completion queue and address vector ([`Endpoint`]), registered memory
//! ([`Region`]) and one-sided reads and writes of a peer's registered memory ([`Remote`]).
//!
//! Every operation here is posted and then waited for before the call returns, so the local
//! buffer it names is borrowed for as long as the provider may touch it.

use std::alloc::Layout;
use std::ffi::{c_void, CStr, CString};
use std::ptr::{null, null_mut, NonNull};
use std::sync::Arc;

use crate::sys;
pub use crate::types::{Error, Peer, Remote};

/// The API version asked for: 1.17, Debian 12's, whose calls every later version keeps.
const API_VERSION: u32 = (1 << 16) | 17;

/// Alignment of a region's memory (a page, which verbs registers most cheaply).
const REGION_ALIGN: usize = 4096;

/// What [`Fabric::open`] offers the provider to require of registrations: everything the
/// production providers (verbs, EFA) may ask for. The provider answers with the subset it
/// needs, which [`Endpoint::register`] and [`Region::remote`] then follow. `FI_MR_PROV_KEY`
/// is offered only when the provider will not open without it: otherwise every key is drawn
/// at random (64 bits), where a software provider would number its keys 1, 2, 3 and let any
/// peer guess another's.
const MR_MODES_OFFERED: u32 =
    sys::FI_MR_LOCAL | sys::FI_MR_VIRT_ADDR | sys::FI_MR_ALLOCATED | sys::FI_MR_ENDPOINT;

/// A libfabric return value: negative is an error number.
fn check(op: &'static str, r: isize) -> Result<usize, Error> {
    usize::try_from(r).map_err(|_| Error {
        op,
        code: i32::try_from(-r).unwrap_or(i32::MAX),
    })
}

/// Closes a libfabric object, once, at the end of its owner's life.
///
/// # Safety
/// `fid` must be an open libfabric object that nothing uses any more.
unsafe fn close(fid: *mut sys::fid) {
    // SAFETY: the caller's contract. A failure leaves the object to the process's end; there
    // is nothing better to do with it in a destructor.
    unsafe { sys::fi_close(fid) };
}

/// The process's handlers of the signals libfabric's providers take over, put back when this
/// value drops. Providers install their own while they start (`shm` cleans up its files, then
/// re-raises with the handler it found, which is the default when it starts before the
/// program's: a daemon stopped with SIGTERM would die of it instead of shutting down); the
/// program's handlers stay in charge, and a clean stop closes what the provider would clean.
struct KeepSignals([(libc::c_int, libc::sigaction); 6]);

impl KeepSignals {
    fn new() -> KeepSignals {
        let mut kept = [
            libc::SIGINT,
            libc::SIGTERM,
            libc::SIGSEGV,
            libc::SIGBUS,
            libc::SIGILL,
            libc::SIGABRT,
        ]
        // SAFETY: an all-zero sigaction is a valid value to be overwritten.
        .map(|s| (s, unsafe { std::mem::zeroed::<libc::sigaction>() }));
        for (signal, action) in &mut kept {
            // SAFETY: reads the current action into a sigaction this value owns.
            unsafe { libc::sigaction(*signal, null(), action) };
        }
        KeepSignals(kept)
    }
}

impl Drop for KeepSignals {
    fn drop(&mut self) {
        for (signal, action) in &self.0 {
            // SAFETY: puts back an action read from the kernel for the same signal.
            unsafe { libc::sigaction(*signal, action, null_mut()) };
        }
    }
}

/// The provider's fabric, domain and the description they were opened from.
struct Domain {
    info: NonNull<sys::fi_info>,
    fabric: NonNull<sys::fid_fabric>,
    domain: NonNull<sys::fid_domain>,
    /// The registration modes the provider requires (`FI_MR_*`).
    mr_mode: u32,
}

// SAFETY: the domain is opened with `FI_THREAD_SAFE`, under which libfabric serialises calls
// on its objects itself; the pointers are owned by this value alone and closed once, in Drop.
unsafe impl Send for Domain {}
// SAFETY: as above.
unsafe impl Sync for Domain {}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: every endpoint and region holds an Arc of this domain, so none is left; the
        // domain goes before its fabric, and the description last.
        unsafe {
            close(&mut (*self.domain.as_ptr()).fid);
            close(&mut (*self.fabric.as_ptr()).fid);
            sys::fi_freeinfo(self.info.as_ptr());
        }
    }
}

/// One provider's fabric and domain (`tcp`, `shm`, `verbs;ofi_rxm`, `efa`, ...), opened for
/// one-sided reads and writes over reliable unconnected endpoints.
#[derive(Clone)]
pub struct Fabric {
    d: Arc<Domain>,
}

impl Fabric {
    /// Opens the first fabric and domain `provider` offers with remote memory access, asking
    /// for thread safety and offering every registration mode the production providers need.
    pub fn open(provider: &str) -> Result<Fabric, Error> {
        let _signals = KeepSignals::new();
        let name = CString::new(provider).map_err(|_| Error {
            op: "provider name",
            code: libc::EINVAL,
        })?;
        let info = match Self::info(&name, MR_MODES_OFFERED) {
            Err(e) if e.code == sys::FI_ENODATA as i32 => {
                Self::info(&name, MR_MODES_OFFERED | sys::FI_MR_PROV_KEY)?
            }
            r => r?,
        };
        Self::open_info(info)
    }

    /// The first description `provider` (`name`) offers for one-sided access over reliable
    /// unconnected endpoints, thread-safe, under the registration modes `mr_modes`.
    fn info(name: &CString, mr_modes: u32) -> Result<NonNull<sys::fi_info>, Error> {
        // SAFETY: fi_allocinfo returns a zeroed description with its attribute structs
        // allocated, or null; it is freed below whatever happens.
        let hints = NonNull::new(unsafe { sys::fi_allocinfo() }).ok_or(Error {
            op: "fi_allocinfo",
            code: libc::ENOMEM,
        })?;
        let mut info: *mut sys::fi_info = null_mut();
        // SAFETY: `hints` and its attribute structs are libfabric's allocations; the provider
        // name is strdup'ed so that fi_freeinfo frees it with the rest.
        let r = unsafe {
            let h = &mut *hints.as_ptr();
            h.caps = u64::from(sys::FI_RMA | sys::FI_READ | sys::FI_WRITE)
                | u64::from(sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE);
            (*h.ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
            let d = &mut *h.domain_attr;
            d.mr_mode = mr_modes as i32;
            d.threading = sys::fi_threading_FI_THREAD_SAFE;
            (*h.fabric_attr).prov_name = libc::strdup(name.as_ptr());
            let r = sys::fi_getinfo(API_VERSION, null(), null(), 0, h, &mut info);
            sys::fi_freeinfo(hints.as_ptr());
            r
        };
        check("fi_getinfo", r as isize)?;
        NonNull::new(info).ok_or(Error {
            op: "fi_getinfo",
            code: sys::FI_ENODATA as i32,
        })
    }

    /// Opens the fabric and domain of `info` (which the result owns, or this frees).
    fn open_info(info: NonNull<sys::fi_info>) -> Result<Fabric, Error> {
        // SAFETY: `info` is the list fi_getinfo returned; its first entry's attributes are
        // valid until it is freed, which the Domain (or the error path) does.
        unsafe {
            let i = info.as_ref();
            let mr_mode = (*i.domain_attr).mr_mode as u32;
            let mut fabric = null_mut();
            if let Err(e) = check(
                "fi_fabric",
                sys::fi_fabric(i.fabric_attr, &mut fabric, null_mut()) as isize,
            ) {
                sys::fi_freeinfo(info.as_ptr());
                return Err(e);
            }
            let fabric = NonNull::new(fabric).expect("fi_fabric succeeded");
            let mut domain = null_mut();
            if let Err(e) = check(
                "fi_domain",
                sys::fi_domain(fabric.as_ptr(), info.as_ptr(), &mut domain, null_mut()) as isize,
            ) {
                close(&mut (*fabric.as_ptr()).fid);
                sys::fi_freeinfo(info.as_ptr());
                return Err(e);
            }
            Ok(Fabric {
                d: Arc::new(Domain {
                    info,
                    fabric,
                    domain: NonNull::new(domain).expect("fi_domain succeeded"),
                    mr_mode,
                }),
            })
        }
    }

    /// The provider that answered (e.g. `tcp;ofi_rxm`).
    pub fn provider(&self) -> String {
        // SAFETY: the description lives as long as the domain; a provider name is a C string.
        unsafe {
            let p = (*self.d.info.as_ref().fabric_attr).prov_name;
            if p.is_null() {
                return String::new();
            }
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }

    /// The registration modes the provider requires (`FI_MR_*` bits).
    pub fn mr_mode(&self) -> u32 {
        self.d.mr_mode
    }

    /// Whether peers address registered memory by its virtual address (`FI_MR_VIRT_ADDR`),
    /// rather than by the offset into the region.
    pub fn virtual_addressing(&self) -> bool {
        self.d.mr_mode & sys::FI_MR_VIRT_ADDR != 0
    }

    /// Whether the provider refuses an access with a key it did not hand out, and an access
    /// outside the registration the key names: true of `tcp`, verbs and EFA; false of `shm`
    /// (and `sm2`), which reach memory by virtual address through the kernel's cross-memory
    /// attach and look at no key. A provider that does not is no boundary between tenants.
    pub fn checks_keys(&self) -> bool {
        let name = self.provider();
        !name
            .split(';')
            .any(|p| matches!(p, "shm" | "sm2" | "sockets"))
    }

    /// Whether the provider numbers the keys itself (`FI_MR_PROV_KEY`): else they are drawn
    /// at random.
    pub fn provider_keys(&self) -> bool {
        self.d.mr_mode & sys::FI_MR_PROV_KEY != 0
    }

    /// A new endpoint of this domain, enabled, with its own completion queue and address
    /// vector. Its operations wait for their completions by polling.
    pub fn endpoint(&self) -> Result<Endpoint, Error> {
        Ok(Endpoint {
            e: Arc::new(EpInner::open(&self.d, false)?),
            next_context: 1,
        })
    }

    /// A new endpoint for serving peers' accesses to memory registered on it: its completion
    /// queue has a wait object, so that [`Endpoint::wait`] can sleep until the provider has
    /// work (a software provider moves the bytes of a peer's access only while the serving
    /// endpoint is progressed).
    pub fn serving_endpoint(&self) -> Result<Endpoint, Error> {
        Ok(Endpoint {
            e: Arc::new(EpInner::open(&self.d, true)?),
            next_context: 1,
        })
    }
}

/// A key nobody can guess: 64 random bits from the kernel.
fn random_key() -> Result<u64, Error> {
    let mut key = [0u8; 8];
    // SAFETY: `key` is 8 writable bytes.
    let n = unsafe { libc::getrandom(key.as_mut_ptr().cast(), key.len(), 0) };
    if n != key.len() as isize {
        return Err(Error {
            op: "getrandom",
            code: std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO),
        });
    }
    Ok(u64::from_ne_bytes(key))
}

/// An endpoint's libfabric objects.
struct EpInner {
    d: Arc<Domain>,
    ep: NonNull<sys::fid_ep>,
    cq: NonNull<sys::fid_cq>,
    av: NonNull<sys::fid_av>,
    /// The completion queue's descriptor to sleep on (a serving endpoint's, where the
    /// provider has one): readable when the provider has work.
    wait_fd: Option<libc::c_int>,
}

// SAFETY: opened in a `FI_THREAD_SAFE` domain; owned here and closed once, in Drop.
unsafe impl Send for EpInner {}
// SAFETY: as above.
unsafe impl Sync for EpInner {}

impl EpInner {
    fn open(d: &Arc<Domain>, wait: bool) -> Result<EpInner, Error> {
        let _signals = KeepSignals::new();
        let attr = |wait_obj| sys::fi_cq_attr {
            format: sys::fi_cq_format_FI_CQ_FORMAT_CONTEXT,
            size: 256,
            wait_obj,
            ..Default::default()
        };
        let mut av_attr = sys::fi_av_attr {
            type_: sys::fi_av_type_FI_AV_TABLE,
            ..Default::default()
        };
        let (mut cq, mut av, mut ep) = (null_mut(), null_mut(), null_mut());
        // SAFETY: the domain is open while `d` lives; each object is closed by EpInner's Drop
        // once made, or here when a later step fails.
        unsafe {
            let domain = d.domain.as_ptr();
            // A serving endpoint's queue gets a descriptor to sleep on where the provider has
            // one (tcp); one that has none (shm) is polled.
            let mut wait_fd = None;
            if wait {
                let mut a = attr(sys::fi_wait_obj_FI_WAIT_FD);
                if sys::fi_cq_open(domain, &mut a, &mut cq, null_mut()) == 0 {
                    let mut fd: libc::c_int = -1;
                    let r = sys::fi_control(
                        &mut (*cq).fid,
                        sys::FI_GETWAIT as i32,
                        (&mut fd as *mut libc::c_int).cast(),
                    );
                    if r == 0 && fd >= 0 {
                        wait_fd = Some(fd);
                    }
                } else {
                    cq = null_mut();
                }
            }
            if cq.is_null() {
                let mut a = attr(sys::fi_wait_obj_FI_WAIT_NONE);
                check(
                    "fi_cq_open",
                    sys::fi_cq_open(domain, &mut a, &mut cq, null_mut()) as isize,
                )?;
            }
            let cq = NonNull::new(cq).expect("fi_cq_open succeeded");
            if let Err(e) = check(
                "fi_av_open",
                sys::fi_av_open(domain, &mut av_attr, &mut av, null_mut()) as isize,
            ) {
                close(&mut (*cq.as_ptr()).fid);
                return Err(e);
            }
            let av = NonNull::new(av).expect("fi_av_open succeeded");
            let made = check(
                "fi_endpoint",
                sys::fi_endpoint(domain, d.info.as_ptr(), &mut ep, null_mut()) as isize,
            );
            if let Err(e) = made {
                close(&mut (*av.as_ptr()).fid);
                close(&mut (*cq.as_ptr()).fid);
                return Err(e);
            }
            let inner = EpInner {
                d: d.clone(),
                ep: NonNull::new(ep).expect("fi_endpoint succeeded"),
                cq,
                av,
                wait_fd,
            };
            let ep = inner.ep.as_ptr();
            check(
                "fi_ep_bind (av)",
                sys::fi_ep_bind(ep, &mut (*av.as_ptr()).fid, 0) as isize,
            )?;
            check(
                "fi_ep_bind (cq)",
                sys::fi_ep_bind(
                    ep,
                    &mut (*cq.as_ptr()).fid,
                    u64::from(sys::FI_TRANSMIT | sys::FI_RECV),
                ) as isize,
            )?;
            check("fi_enable", sys::fi_enable(ep) as isize)?;
            Ok(inner)
        }
    }
}

impl Drop for EpInner {
    fn drop(&mut self) {
        // SAFETY: every region registered through this endpoint holds an Arc of it, so none
        // is left; the endpoint goes before the queue and the address vector bound to it.
        unsafe {
            close(&mut (*self.ep.as_ptr()).fid);
            close(&mut (*self.av.as_ptr()).fid);
            close(&mut (*self.cq.as_ptr()).fid);
        }
    }
}

/// A reliable unconnected endpoint, its completion queue and its address vector.
pub struct Endpoint {
    e: Arc<EpInner>,
    /// The context of the next operation posted (its completion carries it back).
    next_context: usize,
}

impl Endpoint {
    /// This endpoint's address, for a peer's [`Endpoint::insert`].
    pub fn name(&self) -> Result<Vec<u8>, Error> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: `buf` is `len` writable bytes; the endpoint is open.
        let r = unsafe {
            sys::fi_getname(
                &mut (*self.e.ep.as_ptr()).fid,
                buf.as_mut_ptr().cast(),
                &mut len,
            )
        };
        check("fi_getname", r as isize)?;
        buf.truncate(len);
        Ok(buf)
    }

    /// Adds a peer's address ([`Endpoint::name`]) to this endpoint's address vector.
    pub fn insert(&self, name: &[u8]) -> Result<Peer, Error> {
        let mut addr: sys::fi_addr_t = 0;
        // SAFETY: `name` is an address the provider wrote; the vector reads one address of
        // its own format from it and writes one fi_addr_t.
        let n = unsafe {
            sys::fi_av_insert(
                self.e.av.as_ptr(),
                name.as_ptr().cast(),
                1,
                &mut addr,
                0,
                null_mut(),
            )
        };
        match check("fi_av_insert", n as isize)? {
            1 => Ok(Peer(addr)),
            _ => Err(Error {
                op: "fi_av_insert",
                code: libc::EINVAL,
            }),
        }
    }

    /// Registers `len` zeroed bytes of fresh memory on this endpoint's domain, for the
    /// endpoint's own reads and writes, and for peers' reads (`remote_read`) and writes
    /// (`remote_write`) when asked.
    pub fn register(
        &self,
        len: usize,
        remote_read: bool,
        remote_write: bool,
    ) -> Result<Region, Error> {
        let layout = Layout::from_size_align(len.max(1), REGION_ALIGN).map_err(|_| Error {
            op: "region size",
            code: libc::EINVAL,
        })?;
        // SAFETY: the layout's size is non-zero.
        let buf = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or(Error {
            op: "region memory",
            code: libc::ENOMEM,
        })?;
        // SAFETY: `buf` is `len` bytes the region owns; the region closes the registration
        // before it frees them (Region's Drop).
        match unsafe { self.register_memory(buf, len, remote_read, remote_write) } {
            Ok(reg) => Ok(Region {
                reg: std::mem::ManuallyDrop::new(reg),
                layout,
            }),
            Err(e) => {
                // SAFETY: allocated above with `layout`, registered nowhere.
                unsafe { std::alloc::dealloc(buf.as_ptr(), layout) };
                Err(e)
            }
        }
    }

    /// Registers `len` bytes at `base`, memory this endpoint's owner keeps, for peers' reads
    /// (`remote_read`) and writes (`remote_write`) and for the endpoint's own operations.
    ///
    /// # Safety
    /// The `len` bytes at `base` must stay mapped (and writable, with `remote_write`) until the
    /// registration returned is dropped: a peer may reach them until then.
    pub unsafe fn register_memory(
        &self,
        base: NonNull<u8>,
        len: usize,
        remote_read: bool,
        remote_write: bool,
    ) -> Result<Registration, Error> {
        let mut access = u64::from(sys::FI_READ | sys::FI_WRITE);
        if remote_read {
            access |= u64::from(sys::FI_REMOTE_READ);
        }
        if remote_write {
            access |= u64::from(sys::FI_REMOTE_WRITE);
        }
        let d = &self.e.d;
        let key = match d.mr_mode & sys::FI_MR_PROV_KEY {
            0 => random_key()?,
            _ => 0,
        };
        let mut mr = null_mut();
        // SAFETY: the caller keeps the memory until the registration is closed (Registration's
        // Drop).
        let r = unsafe {
            sys::fi_mr_reg(
                d.domain.as_ptr(),
                base.as_ptr().cast(),
                len,
                access,
                0,
                key,
                0,
                &mut mr,
                null_mut(),
            )
        };
        check("fi_mr_reg", r as isize)?;
        let reg = Registration {
            e: self.e.clone(),
            mr: NonNull::new(mr).expect("fi_mr_reg succeeded"),
            base,
            len,
        };
        if d.mr_mode & sys::FI_MR_ENDPOINT != 0 {
            // SAFETY: the registration and the endpoint are open.
            unsafe {
                check(
                    "fi_mr_bind",
                    sys::fi_mr_bind(mr, &mut (*self.e.ep.as_ptr()).fid, 0) as isize,
                )?;
                check("fi_mr_enable", sys::fi_mr_enable(mr) as isize)?;
            }
        }
        Ok(reg)
    }

    /// Reads `dst.len()` bytes of `src` from `offset` on, at `peer`, into `dst`, a range of a
    /// region of this endpoint; returns once they are there. A range outside either region
    /// is refused before anything is posted.
    pub fn read(
        &mut self,
        dst: (&mut Registration, std::ops::Range<usize>),
        peer: Peer,
        src: &Remote,
        offset: u64,
    ) -> Result<(), Error> {
        let (region, range) = dst;
        self.read_many(region, &[(range, peer, *src, offset)], 1)
    }

    /// Writes `src`, a range of a region of this endpoint, into `dst` from `offset` on, at
    /// `peer`; returns once the write is complete. A range outside either region is refused
    /// before anything is posted.
    pub fn write(
        &mut self,
        src: (&Registration, std::ops::Range<usize>),
        peer: Peer,
        dst: &Remote,
        offset: u64,
    ) -> Result<(), Error> {
        let (region, range) = src;
        let len = checked(&range, region.len, offset, dst)?;
        let desc = region.desc();
        let context = self.next_context;
        // SAFETY: as for `read`; the source is only read by the provider, and `src` borrows
        // it until the write completes.
        let ep = self.e.ep.as_ptr();
        let post = || unsafe {
            sys::fi_write(
                ep,
                region.base.as_ptr().add(range.start).cast(),
                len,
                desc,
                peer.0,
                dst.addr + offset,
                dst.key,
                context as *mut c_void,
            )
        };
        self.run("fi_write", post)
    }

    /// Several reads into disjoint ranges of `dst`, up to `depth` of them in flight at once:
    /// each `(range of dst, peer, remote region, offset in it)`. Returns once every read posted
    /// has completed (also when one fails: the first error is returned after the others are
    /// done, so no read is left writing into `dst`). Ranges out of bounds, or overlapping in
    /// `dst`, are refused before anything is posted.
    pub fn read_many(
        &mut self,
        dst: &mut Registration,
        reads: &[(std::ops::Range<usize>, Peer, Remote, u64)],
        depth: usize,
    ) -> Result<(), Error> {
        let mut lens = Vec::with_capacity(reads.len());
        for (range, _, remote, offset) in reads {
            lens.push(checked(range, dst.len, *offset, remote)?);
        }
        let mut order: Vec<&std::ops::Range<usize>> = reads.iter().map(|r| &r.0).collect();
        order.sort_by_key(|r| r.start);
        if order.windows(2).any(|w| w[0].end > w[1].start) {
            return Err(Error {
                op: "overlapping ranges",
                code: libc::EINVAL,
            });
        }
        let (desc, base) = (dst.desc(), dst.base.as_ptr());
        let posts: Vec<Post> = reads
            .iter()
            .zip(&lens)
            .map(|((range, peer, remote, offset), &len)| Post {
                // SAFETY: the range lies inside `dst` (checked above).
                local: unsafe { base.add(range.start) },
                len,
                desc,
                peer: *peer,
                remote: remote.addr + offset,
                key: remote.key,
            })
            .collect();
        // SAFETY: every local range lies inside `dst` and overlaps no other (checked), and
        // `dst` is borrowed mutably for the whole call; the remote ranges were checked against
        // their published lengths.
        unsafe { self.post_reads(&posts, depth, |_, _| {}) }
    }

    /// Whether reads may land in memory nobody registered ([`Endpoint::read_many_into`]): the
    /// provider does not require local registration (`FI_MR_LOCAL`), as `tcp` and `shm` do not.
    pub fn reads_into_any_memory(&self) -> bool {
        self.e.d.mr_mode & sys::FI_MR_LOCAL == 0
    }

    /// Several reads straight into the caller's buffers, which need no registration, up to
    /// `depth` in flight: each `(buffer, peer, remote region, offset in it)`, the buffer's
    /// length read. Returns once every read posted has completed (after a failure too).
    /// Refused, before anything is posted, when the provider requires local registration
    /// ([`Endpoint::reads_into_any_memory`]) or a remote range is out of bounds.
    pub fn read_many_into(
        &mut self,
        reads: &mut [(&mut [u8], Peer, Remote, u64)],
        depth: usize,
    ) -> Result<(), Error> {
        self.read_many_into_each(reads, depth, |_, _| {})
    }

    /// [`Endpoint::read_many_into`], handing `landed` each read's index and bytes as soon as
    /// it completes (to hash them while later reads are in flight, say).
    pub fn read_many_into_each(
        &mut self,
        reads: &mut [(&mut [u8], Peer, Remote, u64)],
        depth: usize,
        landed: impl FnMut(usize, &[u8]),
    ) -> Result<(), Error> {
        if !self.reads_into_any_memory() {
            return Err(Error {
                op: "unregistered buffer (the provider requires FI_MR_LOCAL)",
                code: libc::EINVAL,
            });
        }
        let mut posts = Vec::with_capacity(reads.len());
        for (buf, peer, remote, offset) in reads.iter_mut() {
            let len = checked(&(0..buf.len()), buf.len(), *offset, remote)?;
            posts.push(Post {
                local: buf.as_mut_ptr(),
                len,
                desc: null_mut(),
                peer: *peer,
                remote: remote.addr + *offset,
                key: remote.key,
            });
        }
        // SAFETY: each local range is a whole buffer borrowed mutably (so disjoint from every
        // other) for the whole call; the provider needs no descriptor for it (checked above);
        // the remote ranges were checked against their published lengths.
        unsafe { self.post_reads(&posts, depth, landed) }
    }

    /// Posts `posts`, up to `depth` in flight, and waits for every one posted to complete
    /// (after a failure too), handing `landed` each one's index and bytes as it completes;
    /// returns the first error.
    ///
    /// # Safety
    /// Every local range must be writable, disjoint from the others, reachable with its
    /// descriptor, and untouched by anything else until this returns.
    unsafe fn post_reads(
        &mut self,
        posts: &[Post],
        depth: usize,
        mut landed: impl FnMut(usize, &[u8]),
    ) -> Result<(), Error> {
        let ep = self.e.ep.as_ptr();
        // Contexts `first..first + posts.len()`, one per read.
        let first = self.next_context;
        self.next_context = first.wrapping_add(posts.len() + 1).max(1);
        let (mut posted, mut done, mut failed) = (0, 0, None);
        while done < posted || (posted < posts.len() && failed.is_none()) {
            if posted < posts.len() && posted - done < depth.max(1) && failed.is_none() {
                let p = &posts[posted];
                // SAFETY: the caller's contract for the local range; this loop ends only once
                // every posted read has completed.
                let r = unsafe {
                    sys::fi_read(
                        ep,
                        p.local.cast(),
                        p.len,
                        p.desc,
                        p.peer.0,
                        p.remote,
                        p.key,
                        first.wrapping_add(posted) as *mut c_void,
                    )
                };
                if r == 0 {
                    posted += 1;
                    continue;
                }
                if r != -(sys::FI_EAGAIN as isize) {
                    failed = check("fi_read", r).err();
                }
            }
            match self.poll() {
                Ok(Some(context)) => {
                    done += 1;
                    let i = context.wrapping_sub(first);
                    if let Some(p) = posts.get(i) {
                        // SAFETY: read `i` has completed, so the provider is done with its
                        // range, which nothing else touches until this returns (the contract).
                        landed(i, unsafe { std::slice::from_raw_parts(p.local, p.len) });
                    }
                }
                Ok(None) => std::hint::spin_loop(),
                Err(e) => {
                    done += 1;
                    failed.get_or_insert(e);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Posts one operation (again while the provider says to retry, progressing meanwhile)
    /// and waits for its completion.
    fn run(&mut self, op: &'static str, post: impl Fn() -> isize) -> Result<(), Error> {
        let context = self.next_context;
        self.next_context = self.next_context.wrapping_add(1).max(1);
        loop {
            let r = post();
            if r != -(sys::FI_EAGAIN as isize) {
                check(op, r)?;
                break;
            }
            self.poll()?;
        }
        loop {
            if let Some(done) = self.poll()? {
                debug_assert_eq!(done, context, "one operation at a time");
                return Ok(());
            }
            std::hint::spin_loop();
        }
    }

    /// Waits up to `timeout_ms` for the provider to have work, then drives its progress and
    /// takes a completion off the queue, if there is one (its context). An endpoint from
    /// [`Fabric::serving_endpoint`] sleeps on its queue's descriptor where the provider has
    /// one; otherwise the wait is a poll, then a pause of at most `idle` when it found nothing.
    pub fn wait(
        &mut self,
        timeout_ms: i32,
        idle: std::time::Duration,
    ) -> Result<Option<usize>, Error> {
        let Some(fd) = self.e.wait_fd else {
            let r = self.poll();
            if matches!(r, Ok(None)) {
                std::thread::sleep(idle);
            }
            return r;
        };
        // SAFETY: the fabric and the queue are open; `fids` holds that one queue of the fabric.
        let ready = unsafe {
            let mut fids = [std::ptr::addr_of_mut!((*self.e.cq.as_ptr()).fid)];
            sys::fi_trywait(self.e.d.fabric.as_ptr(), fids.as_mut_ptr(), 1)
        };
        if ready == 0 {
            // Nothing pending: sleep until the descriptor says otherwise.
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd, owned here.
            unsafe { libc::poll(&mut p, 1, timeout_ms) };
        }
        self.poll()
    }

    /// Drives the provider's progress and takes one completion off the queue: its context,
    /// or None when there is none. A software provider (tcp, shm) moves the bytes of a peer's
    /// reads and writes of this endpoint's regions only while its owner polls: an endpoint
    /// that serves peers calls this in a loop.
    pub fn poll(&mut self) -> Result<Option<usize>, Error> {
        let mut entry = sys::fi_cq_entry::default();
        // SAFETY: the queue is open and its format is FI_CQ_FORMAT_CONTEXT: one fi_cq_entry.
        let n = unsafe {
            sys::fi_cq_read(
                self.e.cq.as_ptr(),
                (&mut entry as *mut sys::fi_cq_entry).cast(),
                1,
            )
        };
        if n == 1 {
            return Ok(Some(entry.op_context as usize));
        }
        if n == -(sys::FI_EAGAIN as isize) {
            return Ok(None);
        }
        if n == -(sys::FI_EAVAIL as isize) {
            let mut err = sys::fi_cq_err_entry::default();
            // SAFETY: as above, for the queue's error entry.
            let r = unsafe { sys::fi_cq_readerr(self.e.cq.as_ptr(), &mut err, 0) };
            check("fi_cq_readerr", r)?;
            return Err(Error {
                op: "completion",
                code: err.err,
            });
        }
        check("fi_cq_read", n).map(|_| None)
    }
}

/// One read to post: where it lands (with the descriptor of its registration, or null), and
/// where it reads from.
struct Post {
    local: *mut u8,
    len: usize,
    desc: *mut c_void,
    peer: Peer,
    remote: u64,
    key: u64,
}

/// The length of an operation on `range` of a local region of `local_len` bytes and on a
/// peer's region `remote` from `offset`; refused when either range is out of bounds.
fn checked(
    range: &std::ops::Range<usize>,
    local_len: usize,
    offset: u64,
    remote: &Remote,
) -> Result<usize, Error> {
    let len = range.end.checked_sub(range.start);
    let fits = len.is_some_and(|n| {
        range.end <= local_len
            && offset
                .checked_add(n as u64)
                .is_some_and(|end| end <= remote.len)
    });
    match (fits, len) {
        (true, Some(n)) => Ok(n),
        _ => Err(Error {
            op: "range out of bounds",
            code: libc::EINVAL,
        }),
    }
}

/// A registration of memory on an endpoint's domain: closed when dropped, after which no peer
/// reaches the memory through it.
pub struct Registration {
    e: Arc<EpInner>,
    mr: NonNull<sys::fid_mr>,
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the registration belongs to a `FI_THREAD_SAFE` domain; the memory it names is
// reached through it only by libfabric, and by the owner's `&mut` accesses.
unsafe impl Send for Registration {}
// SAFETY: as above.
unsafe impl Sync for Registration {}

impl Registration {
    /// What a peer needs to read or write the registered memory.
    pub fn remote(&self) -> Remote {
        // SAFETY: the registration is open while this value lives.
        let key = unsafe { sys::fi_mr_key(self.mr.as_ptr()) };
        let addr = match self.e.d.mr_mode & sys::FI_MR_VIRT_ADDR {
            0 => 0,
            _ => self.base.as_ptr() as u64,
        };
        Remote {
            addr,
            key,
            len: self.len as u64,
        }
    }

    /// The registration's descriptor, for the provider's local access to the memory.
    fn desc(&self) -> *mut c_void {
        // SAFETY: the registration is open while this value lives.
        unsafe { sys::fi_mr_desc(self.mr.as_ptr()) }
    }

    /// The memory's first byte.
    pub fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the registration is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: open until now, closed once.
        unsafe { close(&mut (*self.mr.as_ptr()).fid) };
    }
}

/// Memory registered on an endpoint's domain ([`Endpoint::register`]), owned by this value:
/// deregistered, then freed, when it is dropped.
pub struct Region {
    reg: std::mem::ManuallyDrop<Registration>,
    layout: Layout,
}

impl std::ops::Deref for Region {
    type Target = Registration;
    fn deref(&self) -> &Registration {
        &self.reg
    }
}

impl std::ops::DerefMut for Region {
    fn deref_mut(&mut self) -> &mut Registration {
        &mut self.reg
    }
}

impl Region {
    /// The region's bytes. A peer may write them meanwhile when the region admits remote
    /// writes: read what a completed write of the peer's put there.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes owned by this region.
        unsafe { std::slice::from_raw_parts(self.reg.base.as_ptr(), self.reg.len) }
    }

    /// The region's bytes for writing.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; `&mut self` keeps this endpoint's own operations off them.
        unsafe { std::slice::from_raw_parts_mut(self.reg.base.as_ptr(), self.reg.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the registration goes first, so no peer reaches the memory once it is freed;
        // the memory was allocated with `layout`, and the registration is not used again.
        let base = self.reg.base;
        unsafe {
            std::mem::ManuallyDrop::drop(&mut self.reg);
            std::alloc::dealloc(base.as_ptr(), self.layout);
        }
    }
}
