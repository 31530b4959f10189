"""tools/kernel_code_size.py reads each warpgroup role's largest loop from the SASS: a backward branch inside the
role, where the mbarrier retry stubs after the last EXIT, which branch back into the code, are no loops."""

import importlib.util
from pathlib import Path

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   USETMAXREG.DEALLOC.CTAPOOL 0x98 ;
.L_x_1:
        /*0020*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R3 ;
.L_x_9:
        /*0040*/                   STS [R4], R2 ;
        /*0050*/              @P1 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
        /*0070*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0 ;
.L_x_2:
        /*0080*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*0090*/              @P1 BRA `(.L_x_2) ;
        /*00a0*/                   EXIT ;
.L_x_8:
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R3 ;
        /*00c0*/                   BRA `(.L_x_2) ;
"""


def test_each_role_s_largest_loop_is_a_backward_branch_inside_it():
    path = Path(__file__).resolve().parents[1] / "tools" / "kernel_code_size.py"
    spec = importlib.util.spec_from_file_location("kernel_code_size", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._role_loops(SASS) == [0x30 / 1024, 0x10 / 1024]
