//! NIC fusion: one device of the plugin over several NICs (rails), whose connections stripe
//! large messages over all of them (see `rail`). Two ways to get one:
//! - NCCL asks (`makeVDevice`, v9+: `NCCL_NET_FORCE_MERGE`, `NCCL_NET_MERGE_LEVEL`):
//!   [`check_vdevice`] accepts what NCCL's IB transport accepts, and the virtual device is
//!   added after the physical ones;
//! - zero configuration on eRDMA ([`auto_fuse`]): GPU instances often have two eRDMA NICs at
//!   the same distance (SYS, inside a VM) from every GPU, and NCCL neither fuses them (they
//!   are separate PCI devices, beyond its default merge level) nor reliably spreads a GPU's
//!   traffic over both. So by default the plugin offers one device fusing every usable eRDMA
//!   NIC, and every communicator uses all of them. `NCCL_ERDMA_FUSE_NICS=0` turns it off (the
//!   NICs are offered one by one, and NCCL may fuse them itself), `=1` fuses whatever the
//!   devices are (any RoCE/IB NICs of one link layer: tests, other clouds).

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
    pub(crate) guid: u64,
    pub(crate) port: u8,
    pub(crate) max_comms: i32,
}

/// The automatic fusion decision: the NICs fused into device 0 (None: every NIC is its own
/// device), and why, for the log and the info command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fusion {
    pub(crate) members: Option<Vec<usize>>,
    pub(crate) reason: String,
}

/// Decides whether the usable `nics` are offered as one fused device. `nccl_merges`: the
/// user asked NCCL to fuse (NCCL_NET_FORCE_MERGE or NCCL_NET_MERGE_LEVEL set), so automatic
/// fusion stays out of its way.
pub(crate) fn auto_fuse(setting: FuseNics, nics: &[NicInfo], nccl_merges: bool) -> Fusion {
    let no = |reason: String| Fusion {
        members: None,
        reason,
    };
    let candidates: Vec<usize> = match setting {
        FuseNics::Off => return no("NCCL_ERDMA_FUSE_NICS=0".into()),
        FuseNics::On => (0..nics.len()).collect(),
        FuseNics::Auto => {
            if nccl_merges {
                return no(
                    "NCCL_NET_FORCE_MERGE or NCCL_NET_MERGE_LEVEL is set: NCCL fuses NICs \
                     itself"
                        .into(),
                );
            }
            (0..nics.len())
                .filter(|&i| nics[i].class == DeviceClass::Erdma)
                .collect()
        }
    };
    // One link layer: the first candidate's.
    let members: Vec<usize> = candidates
        .iter()
        .copied()
        .filter(|&i| nics[i].link_layer == nics[candidates[0]].link_layer)
        .take(MAX_RAILS)
        .collect();
    let what = match setting {
        FuseNics::Auto => "eRDMA NICs",
        _ => "NICs",
    };
    if members.len() < 2 {
        return no(format!(
            "{} usable {what} (NCCL_ERDMA_FUSE_NICS={}): nothing to fuse",
            members.len(),
            setting
        ));
    }
    let names: Vec<&str> = members.iter().map(|&i| nics[i].name.as_str()).collect();
    Fusion {
        reason: format!(
            "{} {what} fused into one device {} (NCCL_ERDMA_FUSE_NICS={}; =0 offers them one \
             by one)",
            members.len(),
            names.join("+"),
            setting
        ),
        members: Some(members),
    }
}

/// Checks a `makeVDevice` request for the physical devices `devs` (NCCL's indexes) of
/// `physical`, at most `max` of them, as NCCL's IB transport does: none missing, no
/// duplicates, one link layer, and fusion allowed (`NCCL_IB_MERGE_NICS`). Returns the
/// indexes.
pub(crate) fn check_vdevice(
    devs: &[i32],
    max: usize,
    physical: &[NicInfo],
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
        let Some(i) = usize::try_from(d).ok().filter(|&i| i < physical.len()) else {
            return refuse(format!(
                "device {d} is not one of the {} physical devices",
                physical.len()
            ));
        };
        if out.contains(&i) {
            return refuse(format!("device {d} is named twice"));
        }
        out.push(i);
    }
    let first = &physical[out[0]];
    if let Some(other) = out
        .iter()
        .map(|&i| &physical[i])
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

/// The v12 `railId` of each NIC: its position among the NICs of its kind (eRDMA, software,
/// other hardware), in the order NCCL numbers them.
pub(crate) fn rail_ids(nics: &[NicInfo]) -> Vec<i16> {
    let mut seen: Vec<DeviceClass> = Vec::new();
    nics.iter()
        .map(|n| {
            let id = seen.iter().filter(|c| **c == n.class).count();
            seen.push(n.class);
            i16::try_from(id).unwrap_or(-1)
        })
        .collect()
}

/// The properties NCCL sees for a device over `members` (indexes into `nics`): a physical
/// NIC's own, or for several, the first's identity (PCI path, guid: NCCL places it there)
/// with the names joined by `+`, the speeds summed, what every member supports, and
/// `vdevs` (NCCL's indexes of the members; for the automatic fusion, the device itself).
pub(crate) fn props(
    nics: &[NicInfo],
    members: &[usize],
    vdevs: Vec<i32>,
    rail_id: i16,
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
        rail_id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::device::{LINK_LAYER_ETHERNET, LINK_LAYER_IB};

    fn nic(name: &str, class: DeviceClass, link_layer: u8) -> NicInfo {
        NicInfo {
            name: name.into(),
            class,
            link_layer,
            speed_mbps: 100_000,
            ptr_support: 3,
            pci_path: Some(format!("/sys/devices/{name}")),
            guid: name.len() as u64,
            port: 1,
            max_comms: 1000,
        }
    }

    #[test]
    fn two_erdma_nics_are_fused_by_default_and_not_when_turned_off_or_nccl_fuses() {
        let nics = [
            nic("erdma_0", DeviceClass::Erdma, LINK_LAYER_ETHERNET),
            nic("erdma_1", DeviceClass::Erdma, LINK_LAYER_ETHERNET),
            nic("mlx5_0", DeviceClass::Hardware, LINK_LAYER_ETHERNET),
        ];
        let f = auto_fuse(FuseNics::Auto, &nics, false);
        assert_eq!(f.members, Some(vec![0, 1]));
        assert!(f.reason.contains("erdma_0+erdma_1"), "{}", f.reason);
        assert_eq!(auto_fuse(FuseNics::Off, &nics, false).members, None);
        let nccl = auto_fuse(FuseNics::Auto, &nics, true);
        assert_eq!(nccl.members, None);
        assert!(
            nccl.reason.contains("NCCL fuses NICs itself"),
            "{}",
            nccl.reason
        );
        // One eRDMA NIC: nothing to fuse.
        let one = auto_fuse(FuseNics::Auto, &nics[1..], false);
        assert_eq!(one.members, None);
        assert!(one.reason.contains("1 usable eRDMA NICs"), "{}", one.reason);
        // Forced on: any NICs of the first one's link layer.
        let rxe = [
            nic("rxe0", DeviceClass::Software, LINK_LAYER_ETHERNET),
            nic("ib0", DeviceClass::Hardware, LINK_LAYER_IB),
            nic("rxe1", DeviceClass::Software, LINK_LAYER_ETHERNET),
        ];
        assert_eq!(
            auto_fuse(FuseNics::On, &rxe, false).members,
            Some(vec![0, 2])
        );
        assert_eq!(auto_fuse(FuseNics::Auto, &rxe, false).members, None);
    }

    #[test]
    fn make_vdevice_requests_are_checked_as_nccl_ib_checks_them() {
        let nics = [
            nic("rxe0", DeviceClass::Software, LINK_LAYER_ETHERNET),
            nic("rxe1", DeviceClass::Software, LINK_LAYER_ETHERNET),
            nic("ib0", DeviceClass::Hardware, LINK_LAYER_IB),
        ];
        assert_eq!(check_vdevice(&[1, 0], 4, &nics, true).unwrap(), [1, 0]);
        assert_eq!(
            check_vdevice(&[2], 4, &nics, false).unwrap(),
            [2],
            "one device is fine"
        );
        for (devs, max, merge, why) in [
            (&[0, 2][..], 4, true, "different link layers"),
            (&[0, 0][..], 4, true, "named twice"),
            (&[0, 3][..], 4, true, "not one of the 3 physical devices"),
            (&[-1][..], 4, true, "not one of"),
            (&[][..], 4, true, "1 to 4 devices"),
            (&[0, 1, 0, 1, 0][..], 4, true, "1 to 4 devices"),
            (&[0, 1][..], 4, false, "NCCL_IB_MERGE_NICS=0"),
        ] {
            let e = check_vdevice(devs, max, &nics, merge).unwrap_err();
            assert!(e.to_string().contains(why), "{devs:?}: {e}");
            assert_eq!(e.kind(), crate::error::ErrorKind::InvalidUsage);
        }
    }

    #[test]
    fn fused_devices_sum_speeds_join_names_and_keep_what_all_support() {
        let mut nics = vec![
            nic("erdma_0", DeviceClass::Erdma, LINK_LAYER_ETHERNET),
            nic("erdma_1", DeviceClass::Erdma, LINK_LAYER_ETHERNET),
        ];
        nics[1].ptr_support = 1;
        nics[1].max_comms = 10;
        let p = props(&nics, &[0, 1], vec![0, 1], -1, false);
        assert_eq!(p.name(), "erdma_0+erdma_1");
        assert_eq!(p.speed_mbps, 200_000);
        assert_eq!(p.ptr_support, 1, "GPUDirect only if every member has it");
        assert_eq!(p.max_comms, 10);
        assert_eq!(
            p.pci_path.unwrap().to_str().unwrap(),
            "/sys/devices/erdma_0"
        );
        assert_eq!((p.vdevs, p.rail_id), (vec![0, 1], -1));
        let one = props(&nics, &[1], vec![1], 1, false);
        assert_eq!((one.name(), one.speed_mbps), ("erdma_1", 100_000));
    }

    #[test]
    fn rails_are_numbered_within_each_kind_of_nic() {
        let nics = [
            nic("erdma_0", DeviceClass::Erdma, LINK_LAYER_ETHERNET),
            nic("mlx5_0", DeviceClass::Hardware, LINK_LAYER_ETHERNET),
            nic("erdma_1", DeviceClass::Erdma, LINK_LAYER_ETHERNET),
        ];
        assert_eq!(rail_ids(&nics), [0, 0, 1]);
    }
}
