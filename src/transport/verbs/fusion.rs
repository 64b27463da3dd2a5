//! NIC fusion: one device of the plugin over several NICs (rails), whose connections stripe
//! large messages over all of them (see `rail`). By default every NIC is its own device, as
//! NCCL's IB transport offers them: NCCL already spreads its channels over equal NICs and gives
//! each GPU its nearest ones, and each device keeps its NIC's PCI path and NUMA node, so NCCL's
//! GPUDirect and locality decisions stay right. Two ways to get a fused device:
//! - NCCL asks (`makeVDevice`, v9+: `NCCL_NET_FORCE_MERGE`, `NCCL_NET_MERGE_LEVEL`):
//!   [`check_vdevice`] accepts what NCCL's IB transport accepts, and the virtual device is
//!   added after the physical ones;
//! - the user asks (`NCCL_ERDMA_FUSE_NICS=1`, [`plan`]): NICs equivalent for every GPU (one
//!   NUMA node, one link layer) become one device each group; NICs of different NUMA nodes are
//!   not fused (a WARN says so) unless `NCCL_ERDMA_FUSE_NICS=force`. NCCL's own merge settings
//!   win over it. No NIC is ever hidden: a NIC not fused stays its own device.

use std::ffi::CString;

use crate::config::FuseNics;
use crate::error::{Error, Result};
use crate::transport::{DeviceProps, MAX_RAILS};
use crate::verbs::device::DeviceClass;

/// What fusion needs to know about a physical NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NicInfo {
    pub(crate) name: String,
    pub(crate) class: DeviceClass,
    pub(crate) link_layer: u8,
    pub(crate) speed_mbps: i32,
    pub(crate) ptr_support: i32,
    pub(crate) pci_path: Option<String>,
    pub(crate) numa_node: Option<i32>,
    pub(crate) guid: u64,
    pub(crate) port: u8,
    pub(crate) max_comms: i32,
}

/// One device NCCL gets at `init`: its NICs (indexes into the NICs), and why it is what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Planned {
    pub(crate) members: Vec<usize>,
    pub(crate) why: String,
}

/// The devices NCCL gets at `init`, and the fusion decision for the log and the info command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) devices: Vec<Planned>,
    pub(crate) reason: String,
    /// A WARN for the log: fusion asked for and not (all) done.
    pub(crate) warning: Option<String>,
}

/// A NUMA node, for messages.
fn numa(n: Option<i32>) -> String {
    n.map_or("unknown".into(), |n| n.to_string())
}

/// The devices the usable `nics` are offered as, under `setting`. `nccl_merges`: the user
/// asked NCCL to fuse NICs itself (NCCL_NET_FORCE_MERGE or NCCL_NET_MERGE_LEVEL), which wins.
pub(crate) fn plan(setting: FuseNics, nics: &[NicInfo], nccl_merges: bool) -> Plan {
    let one_by_one = |reason: String, warning: Option<String>| Plan {
        devices: (0..nics.len())
            .map(|i| Planned {
                members: vec![i],
                why: "its own NIC".into(),
            })
            .collect(),
        reason,
        warning,
    };
    if setting == FuseNics::Off {
        return one_by_one(
            "each NIC is its own device (NCCL_ERDMA_FUSE_NICS=0): NCCL spreads its channels \
             over them"
                .into(),
            None,
        );
    }
    if nccl_merges {
        let msg = format!(
            "NCCL_ERDMA_FUSE_NICS={setting} and NCCL_NET_FORCE_MERGE or NCCL_NET_MERGE_LEVEL \
             are both set: NCCL fuses the NICs itself, so the plugin offers each NIC as its \
             own device"
        );
        return one_by_one(msg.clone(), Some(msg));
    }
    // Groups of NICs equivalent for every GPU: one link layer and (unless forced) one NUMA
    // node, in the order of their first NIC.
    let key = |n: &NicInfo| {
        (
            n.link_layer,
            (setting != FuseNics::Force).then_some(n.numa_node),
        )
    };
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, n) in nics.iter().enumerate() {
        match groups
            .iter_mut()
            .find(|g| key(&nics[g[0]]) == key(n) && g.len() < MAX_RAILS)
        {
            Some(g) => g.push(i),
            None => groups.push(vec![i]),
        }
    }
    let names = |g: &[usize]| {
        g.iter()
            .map(|&i| nics[i].name.as_str())
            .collect::<Vec<_>>()
            .join("+")
    };
    let devices: Vec<Planned> = groups
        .iter()
        .map(|g| Planned {
            members: g.clone(),
            why: if g.len() == 1 {
                "its own NIC".into()
            } else if setting == FuseNics::Force {
                format!("fused (NCCL_ERDMA_FUSE_NICS=force): {}", names(g))
            } else {
                format!(
                    "fused (NCCL_ERDMA_FUSE_NICS=1): {} on NUMA node {}",
                    names(g),
                    numa(nics[g[0]].numa_node)
                )
            },
        })
        .collect();
    // NICs of one link layer kept apart by their NUMA nodes only.
    let split_by_numa = setting == FuseNics::On
        && groups.iter().enumerate().any(|(a, ga)| {
            groups[a + 1..]
                .iter()
                .any(|gb| nics[ga[0]].link_layer == nics[gb[0]].link_layer)
        });
    let warning = split_by_numa.then(|| {
        let where_: Vec<String> = nics
            .iter()
            .map(|n| format!("{} on NUMA node {}", n.name, numa(n.numa_node)))
            .collect();
        format!(
            "NCCL_ERDMA_FUSE_NICS=1 fuses only NICs of one NUMA node ({}): fused across NUMA \
             nodes, the GPUs of the other node would see the device at the wrong distance and \
             lose GPUDirect RDMA; NCCL_ERDMA_FUSE_NICS=force fuses them anyway",
            where_.join(", ")
        )
    });
    let fused = devices.iter().filter(|d| d.members.len() > 1).count();
    let reason = match fused {
        0 => {
            format!("nothing to fuse (NCCL_ERDMA_FUSE_NICS={setting}): each NIC is its own device")
        }
        _ => format!(
            "{fused} fused device(s) (NCCL_ERDMA_FUSE_NICS={setting}): {}",
            devices
                .iter()
                .map(|d| names(&d.members))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    Plan {
        devices,
        reason,
        warning,
    }
}

/// Checks a `makeVDevice` request for the devices `devs` (NCCL's indexes) of `physical`
/// (each device's NICs), at most `max` of them, as NCCL's IB transport does: none missing, no
/// duplicates, each a single NIC (a device the plugin fused is not fused again), one link
/// layer, and fusion allowed (`NCCL_IB_MERGE_NICS`). Returns the NICs' indexes.
pub(crate) fn check_vdevice(
    devs: &[i32],
    max: usize,
    physical: &[&[usize]],
    nics: &[NicInfo],
    merge_allowed: bool,
) -> Result<Vec<usize>> {
    let refuse = |why: String| {
        Err(Error::usage(format!(
            "makeVDevice of devices {devs:?}: {why}; NCCL falls back to the devices one by one \
             (NCCL_NET_MERGE_LEVEL=LOC stops it from asking)"
        )))
    };
    if devs.is_empty() || devs.len() > max.min(MAX_RAILS) {
        return refuse(format!("1 to {} devices can be fused", max.min(MAX_RAILS)));
    }
    if devs.len() > 1 && !merge_allowed {
        return refuse("NCCL_IB_MERGE_NICS=0".into());
    }
    let mut out = Vec::with_capacity(devs.len());
    for &d in devs {
        let Some(members) = usize::try_from(d).ok().and_then(|i| physical.get(i)) else {
            return refuse(format!(
                "device {d} is not one of the {} physical devices",
                physical.len()
            ));
        };
        let &[nic] = *members else {
            return refuse(format!(
                "device {d} already fuses {} NICs (NCCL_ERDMA_FUSE_NICS)",
                members.len()
            ));
        };
        if out.contains(&nic) {
            return refuse(format!("device {d} is named twice"));
        }
        out.push(nic);
    }
    let first = &nics[out[0]];
    if let Some(other) = out
        .iter()
        .map(|&i| &nics[i])
        .find(|n| n.link_layer != first.link_layer)
    {
        return refuse(format!(
            "{} and {} have different link layers (Ethernet/RoCE vs InfiniBand); pick NICs of \
             one kind with NCCL_IB_HCA",
            first.name, other.name
        ));
    }
    Ok(out)
}

/// The properties NCCL sees for a device over `members` (indexes into `nics`): a physical
/// NIC's own, or for several, the first's identity (PCI path, guid: NCCL places it there)
/// with the names joined by `+`, the speeds summed, what every member supports, and
/// `vdevs` (NCCL's indexes of the members; for the plugin's own fusion, the device itself).
/// `railId` is -1: no rails are configured, as NCCL's IB transport reports it then.
pub(crate) fn props(
    nics: &[NicInfo],
    members: &[usize],
    vdevs: Vec<i32>,
    force_flush: bool,
) -> DeviceProps {
    let first = &nics[members[0]];
    let names: Vec<&str> = members.iter().map(|&i| nics[i].name.as_str()).collect();
    DeviceProps {
        name: CString::new(names.join("+")).unwrap_or_default(),
        pci_path: first
            .pci_path
            .as_ref()
            .and_then(|p| CString::new(p.clone()).ok()),
        guid: first.guid,
        ptr_support: members.iter().fold(-1, |acc, &i| acc & nics[i].ptr_support),
        speed_mbps: members
            .iter()
            .map(|&i| nics[i].speed_mbps)
            .fold(0i32, i32::saturating_add),
        port: i32::from(first.port),
        max_comms: members
            .iter()
            .map(|&i| nics[i].max_comms)
            .min()
            .unwrap_or(1),
        force_flush,
        vdevs,
        rail_id: -1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::device::{LINK_LAYER_ETHERNET, LINK_LAYER_IB};

    fn nic(name: &str, class: DeviceClass, link_layer: u8, numa_node: i32) -> NicInfo {
        NicInfo {
            name: name.into(),
            class,
            link_layer,
            speed_mbps: 100_000,
            ptr_support: 3,
            pci_path: Some(format!("/sys/devices/{name}")),
            numa_node: Some(numa_node),
            guid: name.len() as u64,
            port: 1,
            max_comms: 1000,
        }
    }

    fn members(p: &Plan) -> Vec<Vec<usize>> {
        p.devices.iter().map(|d| d.members.clone()).collect()
    }

    #[test]
    fn by_default_every_nic_is_its_own_device_and_none_is_hidden() {
        let nics = [
            nic("erdma_0", DeviceClass::Erdma, LINK_LAYER_ETHERNET, 0),
            nic("erdma_1", DeviceClass::Erdma, LINK_LAYER_ETHERNET, 0),
            nic("mlx5_0", DeviceClass::Hardware, LINK_LAYER_IB, 1),
        ];
        let p = plan(FuseNics::Off, &nics, false);
        assert_eq!(members(&p), [vec![0], vec![1], vec![2]]);
        assert_eq!(p.warning, None);
        // Asked to fuse: the two eRDMA NICs of NUMA node 0; the IB NIC stays, on its own.
        let p = plan(FuseNics::On, &nics, false);
        assert_eq!(members(&p), [vec![0, 1], vec![2]]);
        assert!(
            p.devices[0].why.contains("NUMA node 0"),
            "{:?}",
            p.devices[0]
        );
        assert_eq!(p.devices[1].why, "its own NIC");
    }

    #[test]
    fn nics_of_different_numa_nodes_are_fused_only_when_forced() {
        // L20N bare metal: one ERI on each NUMA node.
        let l20n = [
            nic("erdma_0", DeviceClass::Erdma, LINK_LAYER_ETHERNET, 0),
            nic("erdma_1", DeviceClass::Erdma, LINK_LAYER_ETHERNET, 1),
        ];
        let p = plan(FuseNics::On, &l20n, false);
        assert_eq!(members(&p), [vec![0], vec![1]]);
        let w = p.warning.expect("a WARN says why not");
        assert!(
            w.contains("erdma_0 on NUMA node 0") && w.contains("force"),
            "{w}"
        );
        let p = plan(FuseNics::Force, &l20n, false);
        assert_eq!(members(&p), [vec![0, 1]]);
        assert_eq!(p.warning, None);
    }

    #[test]
    fn nccl_merging_wins_over_the_plugins_fusion_with_a_warn() {
        let nics = [
            nic("rxe0", DeviceClass::Software, LINK_LAYER_ETHERNET, 0),
            nic("rxe1", DeviceClass::Software, LINK_LAYER_ETHERNET, 0),
        ];
        let p = plan(FuseNics::On, &nics, true);
        assert_eq!(
            members(&p),
            [vec![0], vec![1]],
            "NCCL finds the member names"
        );
        assert!(p.warning.unwrap().contains("NCCL_NET_FORCE_MERGE"));
        assert_eq!(members(&plan(FuseNics::On, &nics, false)), [vec![0, 1]]);
    }

    #[test]
    fn make_vdevice_requests_are_checked_as_nccl_ib_checks_them() {
        let nics = [
            nic("rxe0", DeviceClass::Software, LINK_LAYER_ETHERNET, 0),
            nic("rxe1", DeviceClass::Software, LINK_LAYER_ETHERNET, 0),
            nic("ib0", DeviceClass::Hardware, LINK_LAYER_IB, 0),
        ];
        let one: [&[usize]; 3] = [&[0], &[1], &[2]];
        assert_eq!(
            check_vdevice(&[1, 0], 4, &one, &nics, true).unwrap(),
            [1, 0]
        );
        assert_eq!(
            check_vdevice(&[2], 4, &one, &nics, false).unwrap(),
            [2],
            "one device is fine"
        );
        let fused: [&[usize]; 2] = [&[0, 1], &[2]];
        for (devs, physical, merge, why) in [
            (&[0, 2][..], &one[..], true, "different link layers"),
            (&[0, 0][..], &one[..], true, "named twice"),
            (
                &[0, 3][..],
                &one[..],
                true,
                "not one of the 3 physical devices",
            ),
            (&[-1][..], &one[..], true, "not one of"),
            (&[][..], &one[..], true, "1 to 4 devices"),
            (&[0, 1, 0, 1, 0][..], &one[..], true, "1 to 4 devices"),
            (&[0, 1][..], &one[..], false, "NCCL_IB_MERGE_NICS=0"),
            (&[0, 1][..], &fused[..], true, "already fuses 2 NICs"),
        ] {
            let e = check_vdevice(devs, 4, physical, &nics, merge).unwrap_err();
            assert!(e.to_string().contains(why), "{devs:?}: {e}");
            assert_eq!(e.kind(), crate::error::ErrorKind::InvalidUsage);
        }
    }

    #[test]
    fn fused_devices_sum_speeds_join_names_and_keep_what_all_support() {
        let mut nics = vec![
            nic("erdma_0", DeviceClass::Erdma, LINK_LAYER_ETHERNET, 0),
            nic("erdma_1", DeviceClass::Erdma, LINK_LAYER_ETHERNET, 0),
        ];
        nics[1].ptr_support = 1;
        nics[1].max_comms = 10;
        let p = props(&nics, &[0, 1], vec![0, 1], false);
        assert_eq!(p.name(), "erdma_0+erdma_1");
        assert_eq!(p.speed_mbps, 200_000);
        assert_eq!(p.ptr_support, 1, "GPUDirect only if every member has it");
        assert_eq!(p.max_comms, 10);
        assert_eq!(
            p.pci_path.unwrap().to_str().unwrap(),
            "/sys/devices/erdma_0"
        );
        assert_eq!((p.vdevs, p.rail_id), (vec![0, 1], -1));
        let one = props(&nics, &[1], vec![1], false);
        assert_eq!(
            (one.name(), one.speed_mbps, one.rail_id),
            ("erdma_1", 100_000, -1)
        );
    }
}
